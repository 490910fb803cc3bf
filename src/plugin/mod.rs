//! The kubelet's APIs: Device Plugin v1beta1 (we serve it) and PodResources v1 (we read it).

pub mod authority;
pub mod devices;
pub mod podresources;
pub mod proto;
pub mod registration;
pub mod server;
pub mod uds;
