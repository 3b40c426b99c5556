//! Helpers shared by the engine's concurrency tests (each test binary includes this module
//! with `mod common;`).

// Each test binary uses only part of these helpers.
#![allow(dead_code)]

pub mod crash;
pub mod watchdog;
