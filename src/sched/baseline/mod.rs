//! Baseline policies the papers compare against.
//!
//! * [`timeout`] — TF-Serving style batching: max batch size `s`, max wait `t`.

pub mod timeout;
