//! The kubelet's APIs: Device Plugin v1beta1 and the DRA plugin API v1 (we serve them), PodResources v1
//! (we read it).

pub mod authority;
pub mod devices;
pub mod dra;
pub mod podresources;
pub mod proto;
pub mod registration;
pub mod server;
pub mod uds;
