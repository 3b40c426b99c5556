//! Human units on the command line: sizes like `1GiB`, `4G`, `512k`, durations like `2ms`,
//! and their display. They live in `sce_core::units`, which the server's configuration and
//! the simulator's device models and plots share.

pub use sce_core::units::{format_size, format_unix_time, parse_duration, parse_size};
