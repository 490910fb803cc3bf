//! A plugin's life with the kubelet: serve on a socket in the device-plugin directory, register,
//! and start over whenever the kubelet restarts (it deletes every socket there when it starts).

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

use super::authority::AuthorityRewrite;
use super::proto::v1beta1::device_plugin_server::DevicePluginServer;
use super::proto::v1beta1::registration_client::RegistrationClient;
use super::proto::v1beta1::{DevicePluginOptions, RegisterRequest};
use super::proto::{KUBELET_SOCKET, VERSION};
use super::server::Plugin;
use super::uds;

/// How often the sockets are checked: a kubelet restart is noticed within this.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// Pause between registration attempts while the kubelet is not (yet) listening.
const REGISTER_RETRY: Duration = Duration::from_millis(250);
/// One registration attempt may take this long (the kubelet dials back before it answers).
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// The loop makes progress on each watch tick while registered, and registering again after a
/// kubelet restart takes at most one attempt and one pause: twice that without progress, it is stuck.
pub const REGISTRATION_MAX_SILENCE: Duration =
    REGISTER_TIMEOUT.saturating_add(REGISTER_RETRY).saturating_mul(2);

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// Serves `plugin` as `socket_name` in `dir` and keeps it registered until `shutdown` turns true;
/// then removes its socket. Progress (registered, and watching) beats `registration <resource>` in
/// the plugin's liveness; retrying a kubelet that does not answer is not progress.
pub async fn run(
    plugin: Plugin,
    dir: PathBuf,
    socket_name: String,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let resource = plugin.source.resource().to_string();
    let socket = dir.join(&socket_name);
    let kubelet = dir.join(KUBELET_SOCKET);
    let heartbeat = plugin
        .liveness
        .lasting(format!("registration {resource}"), REGISTRATION_MAX_SILENCE);
    loop {
        // A socket left by a previous run (or a crashed one) would make bind fail.
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", socket.display()))?;
        let ours = inode(&socket);
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(plugin.clone()))
                // Every connection goes through the adapter: kubelets before 1.26 send the socket
                // path as :authority, which h2 rejects.
                .serve_with_incoming(
                    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityRewrite::new)),
                ),
        );
        tracing::info!(%resource, socket = %socket.display(), "serving device plugin");

        // Register, retrying while the kubelet is away; give up this round if our socket vanished.
        let mut kubelet_inode = None;
        while kubelet_inode.is_none() {
            if *shutdown.borrow() {
                break;
            }
            if inode(&socket) != ours {
                break;
            }
            match register(&kubelet, &socket_name, &resource).await {
                Ok(()) => {
                    kubelet_inode = inode(&kubelet);
                    heartbeat.beat();
                    plugin.source.registered(true);
                    tracing::info!(%resource, "registered with the kubelet");
                }
                Err(err) => {
                    tracing::warn!(%resource, error = %err, "registration with the kubelet failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(REGISTER_RETRY) => {}
                        _ = shutdown.changed() => {}
                    }
                }
            }
        }

        // Watch for the kubelet restarting: our socket deleted, or its socket re-created.
        while kubelet_inode.is_some() && !*shutdown.borrow() {
            tokio::select! {
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
                _ = shutdown.changed() => {}
            }
            heartbeat.beat();
            if inode(&socket) != ours {
                tracing::info!(%resource, "plugin socket removed (kubelet restart): serving and registering again");
                break;
            }
            if inode(&kubelet) != kubelet_inode {
                tracing::info!(%resource, "kubelet socket re-created (kubelet restart): serving and registering again");
                break;
            }
        }
        // Dropping the server closes every connection, which ends the ListAndWatch streams.
        plugin.source.registered(false);
        server.abort();
        let _ = server.await;
        if *shutdown.borrow() {
            if inode(&socket) == ours {
                let _ = std::fs::remove_file(&socket);
            }
            tracing::info!(%resource, "device plugin stopped");
            return Ok(());
        }
    }
}

async fn register(kubelet: &Path, endpoint: &str, resource: &str) -> anyhow::Result<()> {
    let attempt = async {
        let channel = uds::connect(kubelet).await?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.into(),
                endpoint: endpoint.into(),
                resource_name: resource.into(),
                options: Some(DevicePluginOptions {
                    pre_start_required: false,
                    get_preferred_allocation_available: true,
                }),
            })
            .await?;
        anyhow::Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, attempt)
        .await
        .map_err(|_| anyhow::anyhow!("the kubelet did not answer within {REGISTER_TIMEOUT:?}"))?
}
