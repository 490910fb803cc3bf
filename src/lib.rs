//! gpumem: share GPUs in Kubernetes by memory.
//!
//! One module per concern (see docs/architecture.md):
//! - [`gpu`]: what GPUs the node has and how they are wired (NVML, or a simulated profile);
//! - [`plugin`]: the kubelet's Device Plugin and PodResources APIs;
//! - [`node`]: the labels and annotations the agent publishes on its Node;
//! - [`inspect`]: `gpumem inspect`, a human view of all of the above;
//! - [`alloc`]: the placement policy (which node, which GPUs), pure, shared by scorer, agent and simulator;
//! - [`claim`]: the GPUClaim resource (a GPU memory request that steps down while it cannot be
//!   placed) and its controller;
//! - [`sim`]: `gpumem simulate`, replaying cluster traces through [`alloc`];
//! - [`http`]: the HTTP/1.1 server of the scorer and of the agent's metrics, with its limits;
//! - [`liveness`]: heartbeats of long-running loops, for the agent's `/healthz`;
//! - [`quantity`]: Kubernetes resource quantities (`5k`, `1.5Gi`, `500m`), read exactly as the API
//!   server reads them, for the agent and the scorer;
//! - [`requests`]: what a pod requests of its node, as kube-scheduler counts it;
//! - [`affinity`]: which nodes a pod's node selector and required node affinity admit, as
//!   kube-scheduler reads them;
//! - [`names`]: Kubernetes object names, checked as the API server checks them;
//! - [`durable`]: files that must be found whole after a crash (written, synced, renamed);
//! - [`tls`]: the extender's TLS (client certificates kube-scheduler presents) and `gpumem certs`.

pub mod affinity;
pub mod agent;
pub mod alloc;
pub mod claim;
pub mod durable;
pub mod gpu;
pub mod http;
pub mod inspect;
pub mod lease;
pub mod liveness;
pub mod names;
pub mod node;
pub mod placer;
pub mod plugin;
pub mod quantity;
pub mod quota;
pub mod requests;
pub mod scorer;
pub mod sim;
pub mod tls;
