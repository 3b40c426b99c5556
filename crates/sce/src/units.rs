//! Human units on the command line: sizes like `1GiB`, `4G`, `512k`, durations like `2ms`,
//! and their display. They live in `sce_sim::units`, which the simulator's device models and
//! plots share.

pub use sce_sim::units::{format_size, parse_duration, parse_size};
