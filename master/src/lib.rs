//! gpuctl master: the replicated cluster state (raft-rs log in sled), the
//! built-in job scheduler, and the gRPC services for gpuctl and agents.
//!
//! [`serve`] runs a master on a bound listener until `shutdown` resolves, so
//! tests and `gpuctl demo` can run one in-process on `127.0.0.1:0`.

pub mod config;
mod error;
pub mod leader;
pub mod metrics;
pub mod raft;
pub mod security;
pub mod service;

/// The pure engine's state machine, allocator and scheduler's decisions,
/// where the master's modules have always found them.
pub use gpuctl_engine::{allocator, scheduler, state};

pub use error::MasterError;

use std::future::Future;
use std::sync::Arc;

pub use config::MasterConfig;
use tokio::sync::watch;

/// Milliseconds since the Unix epoch: the proposer's clock, carried in commands.
pub use gpuctl_core::time::now_ms;

/// Runs a master until `shutdown` resolves: its steps in order, each a
/// function below.
pub async fn serve(
    config: MasterConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MasterError> {
    let security = prepare(&config)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (handle, node_task, initial_commit, round_trips) =
        start_raft(&config, security.as_ref(), &stop_rx).await?;
    log_start(&config, &listener, initial_commit, security.is_some());
    // Loops and servers beside the gRPC server, aborted when it stops.
    let mut side_tasks = spawn_security_tasks(&handle, security.as_ref(), &stop_rx)?;
    let liveness = Arc::new(leader::Liveness::default());
    let hub = Arc::new(leader::frameworks::Hub::default());
    let waits = Arc::new(leader::board::WaitBoard::default());
    side_tasks.extend(spawn_leader_loops(
        &handle, &config, &liveness, &hub, &waits, &stop_rx,
    ));
    if let Some(addr) = config.metrics_listen {
        let render = metrics_renderer(handle.clone(), hub.clone(), round_trips);
        side_tasks.push(
            gpuctl_proto::metrics_server::spawn_server(addr, render, stop_rx.clone())
                .await
                .map_err(|source| MasterError::Listen {
                    addr: addr.to_string(),
                    source,
                })?,
        );
    }
    match spawn_console(&config, &handle, security.as_ref(), &stop_rx).await {
        Ok(tasks) => side_tasks.extend(tasks),
        Err(e) => {
            // The loops started above end with the stop signal.
            let _ = stop_tx.send(true);
            return Err(e);
        }
    }
    let ctx = service::Ctx {
        raft: handle.clone(),
        config: config.clone(),
        liveness,
        hub,
        waits,
        shutdown: stop_rx.clone(),
        security: security.clone(),
    };
    let (node_task, node_stopped) = watch_node(node_task);
    let shutdown = async move {
        // A master whose raft node stopped must not go on answering.
        tokio::select! {
            _ = shutdown => {}
            _ = node_stopped => {
                tracing::error!("raft node stopped; shutting the master down");
            }
        }
        let _ = stop_tx.send(true);
    };
    let result = serve_grpc(router(&ctx), listener, security.as_ref(), shutdown).await;
    // Streams and loops watch `stop_rx`; the node flushes nothing more after
    // this point (every write was flushed before it was acknowledged).
    for t in side_tasks {
        t.abort();
    }
    match node_task.await {
        Ok(Err(e)) => return Err(e.into()),
        Err(e) => tracing::error!(error = %e, "raft node task failed"),
        Ok(Ok(())) => {}
    }
    result?;
    tracing::info!("master stopped");
    Ok(())
}

/// Checks the config, makes the data dir and loads the key material.
fn prepare(config: &MasterConfig) -> Result<Option<Arc<security::Security>>, MasterError> {
    config.check_timeouts()?;
    std::fs::create_dir_all(&config.data_dir).map_err(|source| MasterError::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    config
        .security
        .as_ref()
        .map(|sc| security::Security::load(sc, config.node_id).map(Arc::new))
        .transpose()
}

fn log_start(config: &MasterConfig, listener: &tokio::net::TcpListener, replayed: u64, tls: bool) {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    tracing::info!(%addr, advertise = %config.advertise, data_dir = %config.data_dir.display(), node_id = config.node_id, replayed, tls, "master serving");
    if !tls {
        tracing::warn!(
            %addr,
            "no TLS configured: no certificates, no tokens, every caller may do everything; \
             serving loopback only unless --insecure (see docs/security.md)"
        );
    }
}

/// With TLS: the reloader of the certificate files, and the bootstrap
/// token put in the state.
fn spawn_security_tasks(
    handle: &raft::RaftHandle,
    security: Option<&Arc<security::Security>>,
    stop: &watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, MasterError> {
    let mut tasks = Vec::new();
    if let Some(sec) = security {
        tasks.push(sec.spawn_reloader(stop.clone()));
        if let Some(token) = sec.bootstrap_token()? {
            tasks.push(tokio::spawn(security::seed_bootstrap_token(
                handle.clone(),
                token,
                stop.clone(),
            )));
        }
    }
    Ok(tasks)
}

/// The web console, when `--http-listen` asks for it: its tasks.
async fn spawn_console(
    config: &MasterConfig,
    handle: &raft::RaftHandle,
    security: Option<&Arc<security::Security>>,
    stop: &watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, MasterError> {
    let Some(addr) = config.http_listen else {
        return Ok(Vec::new());
    };
    let console = gpuctl_console::spawn(
        addr,
        console_addresses(handle.clone()),
        security.map(|s| Arc::new(s.console_credentials(config.node_id))),
        stop.clone(),
    )
    .await
    .map_err(|e| match e {
        gpuctl_console::ConsoleError::Listen { addr, source } => {
            MasterError::Listen { addr, source }
        }
        e => MasterError::Config(e.to_string()),
    })?;
    Ok(console.tasks)
}

type NodeTask = tokio::task::JoinHandle<Result<(), raft::NodeError>>;

/// The Raft node's task, and a future that resolves when it stops.
fn watch_node(node_task: NodeTask) -> (NodeTask, impl Future<Output = ()> + Send + 'static) {
    let (done_tx, mut done) = watch::channel(());
    let task = tokio::spawn(async move {
        let r = node_task.await;
        done_tx.send_replace(());
        match r {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "raft node task failed");
                Ok(())
            }
        }
    });
    (task, async move {
        let _ = done.changed().await;
    })
}

/// The leader's loops (each idles on a follower): framework offers, agent
/// liveness, retention, MIG on demand, and the built-in job scheduler.
fn spawn_leader_loops(
    handle: &raft::RaftHandle,
    config: &MasterConfig,
    liveness: &Arc<leader::Liveness>,
    hub: &Arc<leader::frameworks::Hub>,
    waits: &Arc<leader::board::WaitBoard>,
    stop: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(leader::frameworks::run(
            handle.clone(),
            hub.clone(),
            config.frameworks.clone(),
            stop.clone(),
        )),
        tokio::spawn(leader::run(
            handle.clone(),
            config.clone(),
            liveness.clone(),
            stop.clone(),
        )),
        tokio::spawn(leader::retention::run(
            handle.clone(),
            config.retention,
            stop.clone(),
        )),
        tokio::spawn(leader::scheduler::run(
            handle.clone(),
            hub.clone(),
            waits.clone(),
            config.queue_config(),
            stop.clone(),
        )),
    ];
    if config.mig_auto {
        tasks.push(tokio::spawn(leader::mig_auto::run(
            handle.clone(),
            stop.clone(),
        )));
    }
    tasks
}

/// The master API addresses the console's gateway tries, best first: the
/// leader this master knows of, then every member's (this one's included).
fn console_addresses(raft: raft::RaftHandle) -> gpuctl_console::AddressBook {
    Arc::new(move || {
        let mut out = Vec::new();
        if let Some((_, leader)) = raft.leader() {
            out.push(leader);
        }
        for a in raft.addresses().all().into_values() {
            if !out.contains(&a) {
                out.push(a);
            }
        }
        out
    })
}

/// `/metrics`: the state's gauges, the framework hub's counters and the
/// Raft round trips, rendered on each scrape.
fn metrics_renderer(
    raft: raft::RaftHandle,
    hub: Arc<leader::frameworks::Hub>,
    round_trips: raft::transport::RoundTrips,
) -> Arc<dyn Fn() -> String + Send + Sync> {
    Arc::new(move || {
        metrics::render(
            &raft,
            &hub.metrics,
            hub.offers_outstanding(),
            &round_trips.get(),
        )
    })
}

/// The gRPC services under their layers, outermost first: who is calling
/// and may they (service/auth.rs), only the leader serves (gate.rs), each
/// call's cap on its requests, checked at each message's prefix.
fn router(ctx: &service::Ctx) -> tonic::transport::server::Router<RouterLayers> {
    tonic::transport::Server::builder()
        .layer(service::auth::AuthLayer {
            raft: ctx.raft.clone(),
            security: ctx.security.clone(),
        })
        .layer(service::gate::LeaderGateLayer {
            raft: ctx.raft.clone(),
        })
        .layer(service::limits::RequestCapLayer)
        .add_service(service::raft_server(ctx.clone()))
        .add_service(service::operator_server(ctx.clone()))
        .add_service(service::agent_manager_server(ctx.clone()))
        .add_service(service::framework_server(ctx.clone()))
        .add_service(service::identity_server(ctx.clone()))
        .add_service(service::access_server(ctx.clone()))
}

type RouterLayers = tower_layer::Stack<
    service::limits::RequestCapLayer,
    tower_layer::Stack<
        service::gate::LeaderGateLayer,
        tower_layer::Stack<service::auth::AuthLayer, tower_layer::Identity>,
    >,
>;

/// Serves `router` on `listener` (over TLS when configured) until
/// `shutdown`.
async fn serve_grpc(
    router: tonic::transport::server::Router<RouterLayers>,
    listener: tokio::net::TcpListener,
    security: Option<&Arc<security::Security>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    match security {
        Some(sec) => {
            router
                .serve_with_incoming_shutdown(
                    gpuctl_auth::tls::incoming(listener, sec.tls.clone()),
                    shutdown,
                )
                .await
        }
        None => {
            // Small gRPC messages must not wait for Nagle's algorithm: with
            // the client's delayed ACK it added about 40 ms to calls (the
            // scale bench's idle submit-to-RUNNING p50 and ListJobs). The
            // TLS accept stream sets it too.
            let incoming = tokio_stream::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                |s| {
                    let s = s?;
                    s.set_nodelay(true)?;
                    Ok::<_, std::io::Error>(s)
                },
            );
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
}

/// Opens the Raft log and starts this node, then waits until the log
/// already committed is replayed, so that a restarted master never answers
/// from an empty state. Returns the node, its task, the index replayed and
/// the peers' round trips (for /metrics).
async fn start_raft(
    config: &MasterConfig,
    security: Option<&Arc<security::Security>>,
    stop: &watch::Receiver<bool>,
) -> Result<(raft::RaftHandle, NodeTask, u64, raft::transport::RoundTrips), MasterError> {
    // The group's first configuration, used only when the data dir is new.
    let voters: Vec<u64> = if config.join {
        Vec::new()
    } else if config.peers.is_empty() {
        vec![config.node_id]
    } else {
        config.peers.keys().copied().collect()
    };
    let storage = raft::SledStorage::open(&config.data_dir, &voters)?;
    let mut known = config.peers.clone();
    known.insert(config.node_id, config.advertise.clone());
    let addresses = raft::Addresses::new(known);
    let transport = Arc::new(raft::GrpcTransport::new(
        config.node_id,
        config.advertise.clone(),
        addresses.clone(),
        security.map(|s| s.tls.clone()),
        config.election_timeout,
    ));
    let round_trips = transport.round_trips();
    let mut raft_config = raft::RaftNodeConfig::new(config.node_id);
    raft_config.tick = config.election_timeout / raft_config.election_ticks as u32;
    raft_config.snapshot_every = config.snapshot_every;
    let (handle, node_task, initial_commit) =
        raft::node::start(raft_config, storage, transport, addresses, stop.clone())?;
    let mut applied = handle.applied();
    while *applied.borrow() < initial_commit {
        if applied.changed().await.is_err() {
            break;
        }
    }
    Ok((handle, node_task, initial_commit, round_trips))
}
