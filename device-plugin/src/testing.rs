//! Test-only helpers shared by several modules' tests.

pub mod fixtures;
pub mod scripted_api;
