//! libserve: the scheduling and GPU-plumbing core of a deep-learning inference server.
//!
//! Rust users start with [`Runtime::builder`]; C users with `include/libserve.h` (the [`ffi`]
//! module). The design is in `ARCHITECTURE.md`; the layout follows it: sans-IO policies in [`sched`],
//! model formats in [`model`], backends in [`backend`], the runtime's threads in [`runtime`].

pub mod backend;
pub mod error;
pub mod ffi;

pub mod model;
pub mod plan;
pub mod runtime;
pub mod sched;
pub mod sim;
pub mod workload;

pub use backend::{BackendChoice, BackendKind};
pub use error::{Code, Error, Result};
pub use model::{Input, ModelKind, Network, Output};
pub use runtime::{
    CellularOptions, Completion, CompletionQueue, Model, ModelOptions, PolicyConfig, Runtime, RuntimeBuilder,
    StatsSnapshot, SubmitOptions, Tenant, TenantOptions, TenantSpec, Ticket,
};
pub use sched::adaptive::AdaptiveConfig;
pub use sched::baseline::padding::{BucketOrder, PaddingConfig};
pub use sched::baseline::timeout::TimeoutConfig;
pub use sched::elastic::ElasticConfig;

/// The crate version, `MAJOR.MINOR.PATCH`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
