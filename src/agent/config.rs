//! The agent's settings: a YAML file (`--config`), with command-line flags on top.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use serde::Deserialize;

use crate::plugin::devices::{GPU_RESOURCE, MEM_RESOURCE, SHARE_RESOURCE};
use crate::plugin::proto::{DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET};

/// How a container is told which GPU it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<uuid>` in the container's environment (nvidia-container-runtime).
    Envvar,
    /// CDI device names in the `cdi_devices` field of the Allocate response (CRI-level CDI).
    CdiCri,
    /// CDI device names in a `cdi.k8s.io/` annotation of the Allocate response.
    CdiAnnotations,
}

/// Whether gpu-mem containers get libgpumem_cuda.so to hold them to their limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryLimits {
    /// Mount the shim and its accounting into every gpu-mem container (the agent refuses to start
    /// without the shim installed).
    Enforce,
    /// Hand out memory without enforcement: a pod can use more than it asked for.
    Off,
}

/// How the kubelet counts `nvidia.com/gpu-mem` on the device-plugin path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemCounting {
    /// A device plugin with one device per memory unit: the kubelet hands out units (any kubelet;
    /// a 1.36+ kubelet also lists every unit in the pod's status, docs/operate.md).
    Units,
    /// The agent writes the node's total into its Node's capacity and the kubelet admits by quantity;
    /// each container asking memory also asks one `gpumem.io/gpu-share` device (the chart's admission
    /// policy adds it), the one device the kubelet lists for it.
    Shares,
}

/// How the node's GPUs reach the kubelet. A node serves them one way, never both: two paths handing
/// out the same GPUs would each think the other's memory free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The kubelet's Device Plugin API: `nvidia.com/gpu` and `nvidia.com/gpu-mem` (any Kubernetes).
    DevicePlugin,
    /// Dynamic Resource Allocation (Kubernetes 1.34+, consumable capacity): a ResourceSlice with one
    /// device per GPU whose memory is consumable, and the kubelet's DRA plugin API.
    Dra,
}

/// The DRA driver's settings (`dra:` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraConfig {
    /// The driver's name: ResourceSlices, DeviceClasses and claims' results carry it.
    pub driver_name: String,
    /// Directory of the kubelet's plugin registry (the watcher finds our registration socket there).
    pub registry_dir: PathBuf,
    /// Directory of the driver's own socket (`<pluginDir>/<driverName>/dra.sock`).
    pub plugin_dir: PathBuf,
    /// Where the container runtime reads CDI specs from (containerd and CRI-O: `/var/run/cdi`).
    pub cdi_dir: PathBuf,
}

impl Default for DraConfig {
    fn default() -> Self {
        Self {
            driver_name: crate::plugin::proto::DRA_DRIVER_NAME.into(),
            registry_dir: crate::plugin::proto::PLUGIN_REGISTRY_DIR.into(),
            plugin_dir: crate::plugin::proto::DRA_PLUGIN_DIR.into(),
            cdi_dir: "/var/run/cdi".into(),
        }
    }
}

impl DraConfig {
    /// The socket the kubelet calls NodePrepareResources on.
    pub fn endpoint(&self) -> PathBuf {
        self.plugin_dir.join(&self.driver_name).join("dra.sock")
    }
}

/// XIDs caused by applications rather than the GPU (NVIDIA's k8s-device-plugin skips the same set):
/// 13 graphics engine exception, 31 memory page fault, 43 channel stopped, 45 preemptive cleanup,
/// 68 video processor exception, 109 context switch timeout.
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// More share slots than this per GPU would be containers of under a few hundred MiB each, less than a
/// CUDA context takes; the kubelet lists each slot, so the bound also keeps its lists short.
pub const MAX_SHARES_PER_GPU: u32 = 256;

/// Everything the agent needs to know, after the file and the flags are merged.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    pub mode: Mode,
    pub dra: DraConfig,
    pub mem_unit_mib: u64,
    pub gpu_resource: String,
    pub mem_resource: String,
    pub mem_counting: MemCounting,
    /// `memCounting: shares`: the device-plugin resource of share slots, and how many per GPU (the
    /// most containers that can share one GPU).
    pub share_resource: String,
    pub shares_per_gpu: u32,
    pub device_plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    pub pod_resources_poll: Duration,
    pub device_list_strategy: DeviceListStrategy,
    pub ignored_xids: Vec<u64>,
    /// An unhealthy GPU that answers again and has had no critical XID for this long is healthy again.
    pub health_quiet_period: Duration,
    /// How often every GPU is probed for having fallen off the bus.
    pub health_probe_interval: Duration,
    pub profile: Option<String>,
    pub nvml_lib: Option<PathBuf>,
    pub memory_limits: MemoryLimits,
    /// This node's name: with it the agent publishes labels and annotations on its Node.
    pub node_name: Option<String>,
    /// Where `/metrics` and `/healthz` are served; None: not served.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Host directory of the agent's own files (preload file, per-container accounting).
    pub state_dir: PathBuf,
    /// Host path of libgpumem_cuda.so.
    pub shim_path: PathBuf,
    /// The Node's `gpumem.io/gpu-used` (what the pods' processes hold) is written at most this often;
    /// zero: not written.
    pub used_report_interval: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            mode: Mode::DevicePlugin,
            dra: DraConfig::default(),
            mem_unit_mib: 1,
            gpu_resource: GPU_RESOURCE.into(),
            mem_resource: MEM_RESOURCE.into(),
            mem_counting: MemCounting::Units,
            share_resource: SHARE_RESOURCE.into(),
            shares_per_gpu: 32,
            device_plugin_dir: DEVICE_PLUGIN_DIR.into(),
            pod_resources_socket: POD_RESOURCES_SOCKET.into(),
            pod_resources_poll: Duration::from_secs(1),
            device_list_strategy: DeviceListStrategy::Envvar,
            ignored_xids: DEFAULT_IGNORED_XIDS.to_vec(),
            health_quiet_period: Duration::from_secs(300),
            health_probe_interval: Duration::from_secs(5),
            profile: None,
            nvml_lib: None,
            memory_limits: MemoryLimits::Enforce,
            node_name: None,
            metrics_listen: None,
            state_dir: "/var/lib/gpumem".into(),
            shim_path: "/var/lib/gpumem/lib/libgpumem_cuda.so".into(),
            used_report_interval: Duration::from_secs(30),
        }
    }
}

/// The YAML file: every key optional, camelCase as in Kubernetes manifests.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FileConfig {
    mode: Option<Mode>,
    dra: Option<DraFile>,
    #[serde(rename = "memUnitMiB")]
    mem_unit_mib: Option<u64>,
    resource_names: Option<ResourceNames>,
    mem_counting: Option<MemCounting>,
    shares_per_gpu: Option<u32>,
    device_plugin_dir: Option<PathBuf>,
    pod_resources_socket: Option<PathBuf>,
    pod_resources_poll_millis: Option<u64>,
    device_list_strategy: Option<DeviceListStrategy>,
    health: Option<HealthFile>,
    profile: Option<String>,
    nvml_lib: Option<PathBuf>,
    memory_limits: Option<MemoryLimits>,
    state_dir: Option<PathBuf>,
    shim_path: Option<PathBuf>,
    used_report_seconds: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DraFile {
    driver_name: Option<String>,
    registry_dir: Option<PathBuf>,
    plugin_dir: Option<PathBuf>,
    cdi_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResourceNames {
    gpu: Option<String>,
    mem: Option<String>,
    share: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct HealthFile {
    ignored_xids: Option<Vec<u64>>,
    quiet_period_seconds: Option<u64>,
    probe_interval_seconds: Option<u64>,
}

/// `gpumem agent` flags; each one, when given, overrides the config file.
#[derive(Args, Debug, Default)]
pub struct AgentArgs {
    /// YAML config file (keys documented in the README).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How the GPUs reach the kubelet: device plugins, or a DRA driver (Kubernetes 1.34+)
    /// [default: device-plugin].
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// DRA: the kubelet's plugin registry directory [default: /var/lib/kubelet/plugins_registry].
    #[arg(long, value_name = "DIR")]
    pub dra_registry_dir: Option<PathBuf>,
    /// DRA: directory of the driver's socket [default: /var/lib/kubelet/plugins].
    #[arg(long, value_name = "DIR")]
    pub dra_plugin_dir: Option<PathBuf>,
    /// DRA: directory the container runtime reads CDI specs from [default: /var/run/cdi].
    #[arg(long, value_name = "DIR")]
    pub cdi_dir: Option<PathBuf>,
    /// Memory unit of nvidia.com/gpu-mem, in MiB [default: 1].
    #[arg(long)]
    pub mem_unit_mib: Option<u64>,
    /// How the kubelet counts nvidia.com/gpu-mem: units (one device each) or shares (a node total,
    /// and one gpumem.io/gpu-share device per container) [default: units].
    #[arg(long, value_enum)]
    pub mem_counting: Option<MemCounting>,
    /// Share slots per GPU with --mem-counting shares: the most containers sharing one GPU [default: 32].
    #[arg(long, value_name = "N")]
    pub shares_per_gpu: Option<u32>,
    /// Directory of the kubelet's registration socket and the plugins' sockets
    /// [default: /var/lib/kubelet/device-plugins/].
    #[arg(long, value_name = "DIR")]
    pub device_plugin_dir: Option<PathBuf>,
    /// The kubelet's PodResources socket [default: /var/lib/kubelet/pod-resources/kubelet.sock].
    #[arg(long, value_name = "PATH")]
    pub pod_resources_socket: Option<PathBuf>,
    /// How containers are told their GPU [default: envvar].
    #[arg(long, value_enum)]
    pub device_list_strategy: Option<DeviceListStrategy>,
    /// Seconds without a critical XID before an unhealthy GPU that answers again is healthy [default: 300].
    #[arg(long, value_name = "SECONDS")]
    pub health_quiet_period: Option<u64>,
    /// Seconds between lost-GPU probes [default: 5].
    #[arg(long, value_name = "SECONDS")]
    pub health_probe_interval: Option<u64>,
    /// Serve a simulated node (built-in profile or file) instead of this machine's GPUs: for demos.
    #[arg(long, value_name = "NAME|FILE", conflicts_with = "nvml_lib")]
    pub profile: Option<String>,
    /// Load NVML from this file instead of libnvidia-ml.so.1.
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
    /// This node's name (the DaemonSet passes it from the downward API). Without it the agent does not
    /// talk to the API server: no labels, annotations or events on the Node.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// Serve Prometheus `/metrics` and `/healthz` on this address (e.g. 0.0.0.0:9400).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Hold gpu-mem containers to their limit with libgpumem_cuda.so [default: enforce].
    #[arg(long, value_enum)]
    pub memory_limits: Option<MemoryLimits>,
    /// Host directory for the agent's files [default: /var/lib/gpumem].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Host path of libgpumem_cuda.so [default: /var/lib/gpumem/lib/libgpumem_cuda.so].
    #[arg(long, value_name = "PATH")]
    pub shim_path: Option<PathBuf>,
    /// Seconds between writes of the Node's gpumem.io/gpu-used, what the pods' processes hold; 0: not
    /// written [default: 30].
    #[arg(long, value_name = "SECONDS")]
    pub used_report_interval: Option<u64>,
}

impl AgentConfig {
    /// The file (if any), then the flags.
    pub fn load(args: &AgentArgs) -> anyhow::Result<Self> {
        let mut config = Self::default();
        if let Some(path) = &args.config {
            config.apply_file(path)?;
        }
        set(&mut config.mode, args.mode);
        set(&mut config.dra.registry_dir, args.dra_registry_dir.clone());
        set(&mut config.dra.plugin_dir, args.dra_plugin_dir.clone());
        set(&mut config.dra.cdi_dir, args.cdi_dir.clone());
        set(&mut config.mem_unit_mib, args.mem_unit_mib);
        set(&mut config.mem_counting, args.mem_counting);
        set(&mut config.shares_per_gpu, args.shares_per_gpu);
        set(&mut config.device_plugin_dir, args.device_plugin_dir.clone());
        set(
            &mut config.pod_resources_socket,
            args.pod_resources_socket.clone(),
        );
        set(&mut config.device_list_strategy, args.device_list_strategy);
        set(
            &mut config.health_quiet_period,
            args.health_quiet_period.map(Duration::from_secs),
        );
        set(
            &mut config.health_probe_interval,
            args.health_probe_interval.map(Duration::from_secs),
        );
        set(&mut config.memory_limits, args.memory_limits);
        if args.metrics_listen.is_some() {
            config.metrics_listen = args.metrics_listen;
        }
        if args.node_name.is_some() {
            config.node_name = args.node_name.clone();
        }
        set(&mut config.state_dir, args.state_dir.clone());
        set(&mut config.shim_path, args.shim_path.clone());
        set(
            &mut config.used_report_interval,
            args.used_report_interval.map(Duration::from_secs),
        );
        if args.profile.is_some() {
            config.profile = args.profile.clone();
        }
        if args.nvml_lib.is_some() {
            config.nvml_lib = args.nvml_lib.clone();
        }
        config.validate()?;
        Ok(config)
    }

    fn apply_file(&mut self, path: &Path) -> anyhow::Result<()> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        let file: FileConfig = serde_norway::from_str(&text)
            .with_context(|| format!("config {} is not valid", path.display()))?;
        let names = file.resource_names.unwrap_or_default();
        let health = file.health.unwrap_or_default();
        let dra = file.dra.unwrap_or_default();
        set(&mut self.mode, file.mode);
        set(&mut self.dra.driver_name, dra.driver_name);
        set(&mut self.dra.registry_dir, dra.registry_dir);
        set(&mut self.dra.plugin_dir, dra.plugin_dir);
        set(&mut self.dra.cdi_dir, dra.cdi_dir);
        if let Some(v) = file.mem_unit_mib {
            self.mem_unit_mib = v;
        }
        if let Some(v) = names.gpu {
            self.gpu_resource = v;
        }
        if let Some(v) = names.mem {
            self.mem_resource = v;
        }
        set(&mut self.share_resource, names.share);
        set(&mut self.mem_counting, file.mem_counting);
        set(&mut self.shares_per_gpu, file.shares_per_gpu);
        if let Some(v) = file.device_plugin_dir {
            self.device_plugin_dir = v;
        }
        if let Some(v) = file.pod_resources_socket {
            self.pod_resources_socket = v;
        }
        if let Some(v) = file.pod_resources_poll_millis {
            self.pod_resources_poll = Duration::from_millis(v);
        }
        if let Some(v) = file.device_list_strategy {
            self.device_list_strategy = v;
        }
        if let Some(v) = health.ignored_xids {
            self.ignored_xids = v;
        }
        if let Some(v) = health.quiet_period_seconds {
            self.health_quiet_period = Duration::from_secs(v);
        }
        if let Some(v) = health.probe_interval_seconds {
            self.health_probe_interval = Duration::from_secs(v);
        }
        if file.profile.is_some() {
            self.profile = file.profile;
        }
        if file.nvml_lib.is_some() {
            self.nvml_lib = file.nvml_lib;
        }
        set(&mut self.memory_limits, file.memory_limits);
        set(&mut self.state_dir, file.state_dir);
        set(&mut self.shim_path, file.shim_path);
        set(
            &mut self.used_report_interval,
            file.used_report_seconds.map(Duration::from_secs),
        );
        Ok(())
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.mem_unit_mib >= 1, "memUnitMiB must be at least 1");
        anyhow::ensure!(
            self.gpu_resource != self.mem_resource
                && self.share_resource != self.gpu_resource
                && self.share_resource != self.mem_resource,
            "the resource names must differ"
        );
        anyhow::ensure!(
            (1..=MAX_SHARES_PER_GPU).contains(&self.shares_per_gpu),
            "sharesPerGpu must be between 1 and {MAX_SHARES_PER_GPU}, not {}",
            self.shares_per_gpu
        );
        for (key, name) in [
            ("resourceNames.gpu", &self.gpu_resource),
            ("resourceNames.mem", &self.mem_resource),
            ("resourceNames.share", &self.share_resource),
        ] {
            if let Err(why) = crate::names::check_extended_resource_name(name) {
                anyhow::bail!("{key}: {name:?} is not a valid extended resource name: {why}");
            }
        }
        if let Err(why) = crate::names::check_subdomain(&self.dra.driver_name) {
            anyhow::bail!(
                "dra.driverName: {:?} is not a valid driver name (a DNS subdomain): {why}",
                self.dra.driver_name
            );
        }
        anyhow::ensure!(
            !self.pod_resources_poll.is_zero(),
            "podResourcesPollMillis must be positive"
        );
        anyhow::ensure!(
            !self.health_probe_interval.is_zero(),
            "health.probeIntervalSeconds must be positive"
        );
        Ok(())
    }
}

/// Overrides `target` when a value was given.
fn set<T>(target: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *target = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.yaml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn file_then_flags() {
        let (_dir, path) = write(
            "memUnitMiB: 4\nresourceNames:\n  mem: example.com/vram\ndeviceListStrategy: cdi-cri\n\
             health:\n  ignoredXids: [13]\n  quietPeriodSeconds: 60\nusedReportSeconds: 0\n",
        );
        let args = AgentArgs {
            config: Some(path),
            mem_unit_mib: Some(8),
            ..Default::default()
        };
        let config = AgentConfig::load(&args).unwrap();
        assert_eq!(config.mem_unit_mib, 8, "the flag wins");
        assert_eq!(config.mem_resource, "example.com/vram");
        assert_eq!(config.gpu_resource, GPU_RESOURCE);
        assert_eq!(config.device_list_strategy, DeviceListStrategy::CdiCri);
        assert_eq!(config.ignored_xids, vec![13]);
        assert_eq!(config.health_quiet_period, Duration::from_secs(60));
        assert!(config.used_report_interval.is_zero(), "0: not written");
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let (_dir, path) = write("memUnitMib: 4\n");
        let err = format!(
            "{:#}",
            AgentConfig::load(&AgentArgs {
                config: Some(path),
                ..Default::default()
            })
            .unwrap_err()
        );
        assert!(
            err.contains("memUnitMib") && err.contains("unknown field"),
            "{err}"
        );
        let (_dir, path) = write("resourceNames: {gpu: gpu}\n");
        let err = format!(
            "{:#}",
            AgentConfig::load(&AgentArgs {
                config: Some(path),
                ..Default::default()
            })
            .unwrap_err()
        );
        assert!(err.contains("extended"), "{err}");
        let err = AgentConfig::load(&AgentArgs {
            mem_unit_mib: Some(0),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("memUnitMiB"));
    }

    #[test]
    fn shares_are_chosen_in_the_file_or_by_flag_and_bounded() {
        let (_dir, path) =
            write("memCounting: shares\nsharesPerGpu: 8\nresourceNames:\n  share: example.com/slot\n");
        let config = AgentConfig::load(&AgentArgs {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(config.mem_counting, MemCounting::Shares);
        assert_eq!(
            (config.shares_per_gpu, config.share_resource.as_str()),
            (8, "example.com/slot")
        );
        let config = AgentConfig::load(&AgentArgs {
            config: Some(path),
            mem_counting: Some(MemCounting::Units),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(config.mem_counting, MemCounting::Units, "the flag wins");
        assert_eq!(AgentConfig::default().mem_counting, MemCounting::Units);
        for bad in [0, MAX_SHARES_PER_GPU + 1] {
            let err = AgentConfig::load(&AgentArgs {
                shares_per_gpu: Some(bad),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("sharesPerGpu") && err.contains(&bad.to_string()),
                "{err}"
            );
        }
        let (_dir, path) = write("resourceNames:\n  share: nvidia.com/gpu-mem\n");
        let err = AgentConfig::load(&AgentArgs {
            config: Some(path),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("must differ"), "{err}");
    }

    #[test]
    fn a_bad_resource_name_is_refused_at_load_naming_the_key() {
        let (_dir, path) = write("resourceNames:\n  mem: example.com/gpu mem\n");
        let err = AgentConfig::load(&AgentArgs {
            config: Some(path),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("resourceNames.mem") && err.contains("\"example.com/gpu mem\""),
            "{err}"
        );
    }
}
