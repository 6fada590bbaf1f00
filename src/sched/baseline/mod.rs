//! Baseline policies the papers compare against.
//!
//! * [`padding`] — TF/MXNet graph batching: size buckets, round-robin, padded batches.
//! * [`timeout`] — TF-Serving style batching: max batch size `s`, max wait `t`.

pub mod padding;
pub mod timeout;
