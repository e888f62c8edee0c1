//! The decode kernel against a float64 reference, on every kernel set this CPU runs.

mod attention;
mod helpers;
mod runs;
#[cfg(target_arch = "x86_64")]
mod vector;
