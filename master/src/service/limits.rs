//! How big a request each call takes. A tower layer over the whole server
//! reads the 5-byte gRPC prefix of each request message as it streams by
//! and refuses a message declared bigger than its call's cap with
//! `RESOURCE_EXHAUSTED`, naming the call, the size and the cap, before a
//! byte of it is buffered or decoded. One cap for every call of a service
//! let a tenant's 13 MiB SubmitJob (a million env variables) through to
//! decoding and checking, which took seconds on an async worker and froze
//! the master's timers and sockets: the leader lost its term.
//!
//! Each cap is above the biggest message that `gpuctl_core::convert`
//! accepts for the call (the tests build those), so a request within the
//! field limits always reaches the checks that name the field; a request
//! the cap refuses would have been refused there anyway, at a cost
//! proportional to its size. Where no field limit bounds a call's size
//! (the batches of agents and frameworks), the cap is the 16 MiB every
//! call had before.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tonic::body::BoxBody;
use tonic::Status;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// Calls not listed in [`CAPS`]: ids, filters, a token, a certificate
/// request. (A call no service has is refused by the auth layer.)
pub const DEFAULT_CAP: usize = 64 * KIB;

/// The largest request message of each call that takes more than
/// [`DEFAULT_CAP`], in bytes.
pub const CAPS: &[(&str, usize)] = &[
    // A snapshot is one message; only masters may call it (auth.rs).
    (
        "/gpuctl.v1.RaftTransport/Step",
        crate::raft::transport::MAX_RAFT_MESSAGE_BYTES,
    ),
    // The biggest spec the field limits allow is 662 KiB (tests below).
    ("/gpuctl.v1.Operator/SubmitJob", MIB),
    // Up to 65,536 running task ids of up to 257 bytes: 17.5 MiB in all.
    ("/gpuctl.v1.AgentManager/Register", 20 * MIB),
    ("/gpuctl.v1.AgentManager/Heartbeat", MIB),
    ("/gpuctl.v1.AgentManager/UpdateStatus", MIB),
    // Up to 1,024 updates; no field limit bounds the batch in bytes.
    ("/gpuctl.v1.AgentManager/UpdateStatuses", 16 * MIB),
    // Any number of launches (each up to a job's payload) or tasks.
    ("/gpuctl.v1.Scheduler/Accept", 16 * MIB),
    ("/gpuctl.v1.Scheduler/Reconcile", 16 * MIB),
    ("/gpuctl.v1.Scheduler/Subscribe", MIB),
    ("/gpuctl.v1.Scheduler/UpdateFramework", MIB),
    ("/gpuctl.v1.Scheduler/Decline", MIB),
    ("/gpuctl.v1.Scheduler/Revive", MIB),
    ("/gpuctl.v1.Scheduler/Suppress", MIB),
];

/// The largest request message `path` (`/package.Service/Method`) takes.
pub fn request_cap(path: &str) -> usize {
    CAPS.iter()
        .find(|(p, _)| *p == path)
        .map_or(DEFAULT_CAP, |(_, cap)| *cap)
}

/// The largest cap of `service`'s calls: tonic's own limit for the
/// service, a second line behind the layer.
pub fn service_cap(service: &str) -> usize {
    CAPS.iter()
        .filter(|(p, _)| {
            p.strip_prefix('/')
                .and_then(|p| p.split_once('/'))
                .is_some_and(|(s, _)| s == service)
        })
        .map(|(_, cap)| *cap)
        .fold(DEFAULT_CAP, usize::max)
}

/// `n` bytes for people: "1 MiB", "64 KiB", "13.4 MiB", "900 bytes".
pub fn size_words(n: usize) -> String {
    let unit = |u: usize, name: &str| {
        if n % u == 0 {
            format!("{} {name}", n / u)
        } else {
            format!("{:.1} {name}", n as f64 / u as f64)
        }
    };
    if n >= MIB {
        unit(MIB, "MiB")
    } else if n >= KIB {
        unit(KIB, "KiB")
    } else {
        format!("{n} bytes")
    }
}

/// The answer to a request message of `len` bytes on `path`, whose cap is
/// `cap`.
pub fn too_big(path: &str, len: usize, cap: usize) -> Status {
    let size = if len >= KIB {
        format!("{len} bytes ({})", size_words(len))
    } else {
        format!("{len} bytes")
    };
    Status::resource_exhausted(format!(
        "{}: the request message is {size}; this call takes at most {}",
        path.trim_start_matches('/'),
        size_words(cap)
    ))
}

#[derive(Clone, Copy, Debug, Default)]
pub struct RequestCapLayer;

impl<S> tower_layer::Layer<S> for RequestCapLayer {
    type Service = RequestCap<S>;

    fn layer(&self, inner: S) -> RequestCap<S> {
        RequestCap { inner }
    }
}

#[derive(Clone, Debug)]
pub struct RequestCap<S> {
    inner: S,
}

impl<S> tower_service::Service<http::Request<BoxBody>> for RequestCap<S>
where
    S: tower_service::Service<http::Request<BoxBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        let path = req.uri().path().to_string();
        let cap = request_cap(&path);
        self.inner
            .call(req.map(|body| BoxBody::new(CappedBody::new(body, path, cap))))
    }
}

/// A request body that fails, with [`too_big`], at the prefix of the first
/// message declared bigger than `cap`. tonic hands a body's error to the
/// caller as it is.
pub struct CappedBody {
    inner: BoxBody,
    path: String,
    cap: usize,
    /// The prefix being read (compression flag, then length big-endian).
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to pass.
    left: usize,
    refused: bool,
}

impl CappedBody {
    pub fn new(inner: BoxBody, path: String, cap: usize) -> CappedBody {
        CappedBody {
            inner,
            path,
            cap,
            prefix: [0; 5],
            prefix_len: 0,
            left: 0,
            refused: false,
        }
    }

    /// Follows the messages' framing through `data`; the first message
    /// over the cap is an error.
    fn scan(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len());
                self.left -= n;
                data = &data[n..];
                continue;
            }
            let n = (5 - self.prefix_len).min(data.len());
            self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
            self.prefix_len += n;
            data = &data[n..];
            if self.prefix_len == 5 {
                self.prefix_len = 0;
                let [_, a, b, c, d] = self.prefix;
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > self.cap {
                    return Err(too_big(&self.path, len, self.cap));
                }
                self.left = len;
            }
        }
        Ok(())
    }
}

impl Body for CappedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            if let Err(status) = self.scan(data) {
                self.refused = true;
                tracing::debug!(path = %self.path, error = %status.message(), "request refused");
                return Poll::Ready(Some(Err(status)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::convert::*;
    use gpuctl_core::types::{AgentInfo, JobSpec, StatusUpdate};
    use gpuctl_proto::pb;
    use prost::Message as _;

    /// `n` bytes of text starting with `prefix` (unique names of one size).
    fn text(prefix: &str, n: usize) -> String {
        format!("{prefix}{}", "x".repeat(n - prefix.len()))
    }

    /// A submit with every field at its limit: convert takes it, and the
    /// cap leaves room above it.
    #[test]
    fn the_biggest_submit_convert_takes_is_under_the_cap() {
        let env: std::collections::HashMap<String, String> = (0..MAX_ENV_VARS)
            .map(|i| {
                (
                    text(&format!("K{i}"), MAX_ENV_TOTAL_BYTES / MAX_ENV_VARS),
                    String::new(),
                )
            })
            .collect();
        let spec = pb::JobSpec {
            name: text("n", MAX_NAME_LEN),
            image: text("i", MAX_IMAGE_LEN),
            command: (0..MAX_COMMAND_ARGS)
                .map(|i| text(&format!("a{i}"), MAX_COMMAND_BYTES / MAX_COMMAND_ARGS))
                .collect(),
            secret_env: env.keys().cloned().collect(),
            env,
            resources: Some(pb::Resources {
                cpus: MAX_CPUS,
                mem_mib: MAX_MEM_MIB,
                // One MIG device (MAX_GPUS whole GPUs is as long a varint).
                gpus: 1,
                ports: MAX_TASK_PORTS,
            }),
            placement: Some(pb::Placement {
                policy: "spread".into(),
                gpu_model: text("m", MAX_ATTR_LEN),
                gpu_mem_min_mib: MAX_MEM_MIB,
                // The longest profile name (legal with 1 GPU per task).
                mig: format!("1g.{}gb", "1".repeat(MAX_MIG_PROFILE_LEN - 5)),
                // A fraction excludes a MIG device, and is shorter.
                gpu_mem_mib: 0,
                gpu_compute_pct: 0,
                constraints: (0..MAX_CONSTRAINTS)
                    .map(|i| {
                        (
                            text(&format!("c{i}"), MAX_ATTR_LEN),
                            text("v", MAX_ATTR_LEN),
                        )
                    })
                    .collect(),
            }),
            tenant: text("t", MAX_NAME_LEN),
            security: Some(pb::TaskSecurity {
                user: "4294967294:4294967294".into(),
                mounts: (0..MAX_MOUNTS)
                    .map(|i| pb::HostMount {
                        host_path: text(&format!("/h{i}/"), MAX_PATH_LEN),
                        container_path: text(&format!("/c{i}/"), MAX_PATH_LEN),
                        read_write: true,
                    })
                    .collect(),
                ..Default::default()
            }),
            require_cuda: format!(
                "cuda>=12.0{}",
                " ".repeat(gpuctl_core::cuda_req::MAX_EXPR_LEN - 10)
            ),
            priority: i32::MIN,
            replicas: MAX_REPLICAS,
            min_replicas: MAX_REPLICAS - 1,
            // "never" is a letter longer but refuses max_retries, whose
            // varint is longer; the longest backoff.
            restart_policy: "gang".into(),
            restart_backoff_ms: Some(gpuctl_core::convert::MAX_FIRST_RESTART_BACKOFF_MS),
            preflight: true,
            max_retries: MAX_RETRIES,
            no_requeue: true,
            no_fence: true,
            stop_grace_ms: Some(gpuctl_core::convert::MAX_STOP_GRACE_MS),
            checkpoint_dir: text("/k/", MAX_PATH_LEN),
            hang_timeout_ms: None,
            options: None,
            // The master's to set; refused in a submit.
            service: String::new(),
        };
        let req = pb::SubmitJobRequest {
            request_id: text("r", MAX_NAME_LEN),
            spec: Some(spec.clone()),
        };
        if let Err(e) = JobSpec::try_from(spec) {
            panic!("the biggest spec is a good one: {e}");
        }
        let len = req.encoded_len();
        eprintln!("the biggest SubmitJob: {len} bytes ({})", size_words(len));
        assert!(
            len < request_cap("/gpuctl.v1.Operator/SubmitJob") * 3 / 4,
            "{len}"
        );
    }

    /// A registration with every list at its limit.
    #[test]
    fn the_biggest_registration_convert_takes_is_under_the_cap() {
        let uuid = |i: usize| text(&format!("GPU-{i}-"), MAX_GPU_UUID_LEN);
        let gpus: Vec<pb::Gpu> = (0..MAX_AGENT_GPUS)
            .map(|i| pb::Gpu {
                uuid: uuid(i),
                index: i as u32,
                minor: i as u32,
                model: text("m", MAX_ATTR_LEN),
                memory_mib: MAX_MEM_MIB,
                healthy: false,
                pci_bus_id: text("p", MAX_ATTR_LEN),
                serial: text("s", MAX_ATTR_LEN),
                numa_node: Some(1),
                compute_capability: "9.0".into(),
                peers: (0..MAX_AGENT_GPUS)
                    .filter(|j| *j != i)
                    .map(|j| pb::GpuPeer {
                        uuid: uuid(j),
                        nvlinks: 18,
                        pcie: "NODE".into(),
                    })
                    .collect(),
                unhealthy_reason: text("r", MAX_REASON_LEN),
                mig: Some(pb::MigInfo {
                    enabled: true,
                    pending: Some(false),
                    devices: (0..MAX_MIG_DEVICES)
                        .map(|d| pb::MigDevice {
                            uuid: text(&format!("MIG-{i}-{d}-"), MAX_GPU_UUID_LEN),
                            profile: text("p", MAX_MIG_PROFILE_LEN),
                            memory_mib: MAX_MEM_MIB,
                            gpu_slices: 7,
                            compute_slices: 7,
                            gi_id: 14,
                            ci_id: 7,
                            caps_minors: vec![u32::MAX; MAX_MIG_CAPS],
                        })
                        .collect(),
                    free: (0..MAX_MIG_DEVICES)
                        .map(|_| pb::MigCapacity {
                            profile: text("p", MAX_MIG_PROFILE_LEN),
                            count: 7,
                        })
                        .collect(),
                    capable: true,
                    profiles: (0..MAX_MIG_DEVICES)
                        .map(|_| pb::MigProfile {
                            name: text("p", MAX_MIG_PROFILE_LEN),
                            gpu_slices: 7,
                            memory_mib: MAX_MEM_MIB,
                            max_count: 7,
                        })
                        .collect(),
                }),
            })
            .collect();
        let req = pb::RegisterRequest {
            agent_id: text("a", MAX_NAME_LEN),
            hostname: text("h", MAX_HOSTNAME_LEN),
            address: text("h", MAX_ADDRESS_LEN - 6) + ":65535",
            total: Some(pb::Resources {
                cpus: MAX_CPUS,
                mem_mib: MAX_MEM_MIB,
                // Devices: every GPU in MIG mode with its most MIG devices.
                gpus: (MAX_AGENT_GPUS * MAX_MIG_DEVICES) as u32,
                ports: 0,
            }),
            gpus,
            running_task_ids: (0..MAX_AGENT_TASKS)
                .map(|i| text(&format!("f.{i}"), 2 * MAX_NAME_LEN + 1))
                .collect(),
            attributes: (0..MAX_AGENT_ATTRIBUTES)
                .map(|i| {
                    (
                        text(&format!("k{i}"), MAX_ATTR_LEN),
                        text("v", MAX_ATTR_VALUE_LEN),
                    )
                })
                .collect(),
            driver_version: text("d", MAX_ATTR_LEN),
            cuda_driver_version: text("c", MAX_ATTR_LEN),
            allowed_mounts: (0..MAX_ALLOWED_MOUNTS)
                .map(|i| text(&format!("/m{i}/"), MAX_PATH_LEN))
                .collect(),
            ..Default::default()
        };
        let len = req.encoded_len();
        if let Err(e) = AgentInfo::try_from(req) {
            panic!("the biggest registration is a good one: {e}");
        }
        eprintln!("the biggest Register: {len} bytes ({})", size_words(len));
        assert!(
            len < request_cap("/gpuctl.v1.AgentManager/Register"),
            "{len}"
        );
    }

    /// One status update with every field at its limit.
    #[test]
    fn the_biggest_status_update_convert_takes_is_under_the_cap() {
        let req = pb::StatusUpdate {
            // Sent only with RUNNING; its size counts all the same.
            health: Some(pb::TaskHealth {
                ready: true,
                failure: text("f", MAX_REASON_LEN),
            }),
            enforcement: String::new(),
            agent_id: text("a", MAX_NAME_LEN),
            task_id: text("t", MAX_NAME_LEN),
            state: pb::TaskState::TaskFailed as i32,
            exit_code: Some(i32::MIN),
            message: text("m", MAX_REASON_LEN),
            uuid: vec![0xff; 16],
            reason: pb::Reason::DriverRequirementUnmet as i32,
            latest_state: pb::TaskState::TaskFailed as i32,
            requires: (0..gpuctl_core::cuda_req::MAX_EXPRS)
                .map(|_| {
                    format!(
                        "cuda>=12.0{}",
                        " ".repeat(gpuctl_core::cuda_req::MAX_EXPR_LEN - 10)
                    )
                })
                .collect(),
            failed_gpus: Vec::new(),
        };
        let len = req.encoded_len();
        let mut failed = req.clone();
        failed.health = None;
        if let Err(e) = StatusUpdate::try_from(failed) {
            panic!("the biggest status update is a good one: {e}");
        }
        assert!(
            len < request_cap("/gpuctl.v1.AgentManager/UpdateStatus"),
            "{len}"
        );
    }

    /// A body of these chunks, as they arrive.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    /// A gRPC message: its 5-byte prefix and `len` bytes.
    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    /// Reads `chunks` (cut from `wire` at `cuts`) through a body capped at
    /// `cap`: the bytes that passed, and the error if one came.
    fn read(wire: &[u8], cuts: &[usize], cap: usize) -> (usize, Option<Status>) {
        let mut chunks = std::collections::VecDeque::new();
        let mut at = 0;
        for &c in cuts.iter().chain([&wire.len()]) {
            chunks.push_back(Bytes::copy_from_slice(&wire[at..c]));
            at = c;
        }
        let mut body = CappedBody::new(
            BoxBody::new(Chunks(chunks)),
            "/gpuctl.v1.Operator/SubmitJob".into(),
            cap,
        );
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut passed = 0;
        loop {
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(f))) => passed += f.data_ref().map_or(0, Bytes::len),
                Poll::Ready(Some(Err(s))) => {
                    // Nothing after the refusal.
                    assert!(matches!(
                        Pin::new(&mut body).poll_frame(&mut cx),
                        Poll::Ready(None)
                    ));
                    return (passed, Some(s));
                }
                Poll::Ready(None) => return (passed, None),
                Poll::Pending => unreachable!("the chunks are all there"),
            }
        }
    }

    #[test]
    fn a_message_over_the_cap_is_refused_at_its_prefix() {
        // Two messages at the cap, then one over it; prefixes cut across
        // chunks every way.
        let cap = 100;
        let mut wire = message(cap);
        wire.extend(message(0));
        wire.extend(message(cap));
        let good = wire.len();
        wire.extend(message(cap + 1));
        for cuts in [
            vec![],
            vec![1, 2, 3, 4],
            vec![good - 1],
            vec![good + 2, good + 4],
            vec![50, good, good + 5],
        ] {
            let (passed, err) = read(&wire, &cuts, cap);
            let err = err.unwrap_or_else(|| panic!("{cuts:?}: not refused"));
            assert_eq!(err.code(), tonic::Code::ResourceExhausted);
            assert_eq!(
                err.message(),
                "gpuctl.v1.Operator/SubmitJob: the request message is 101 bytes; \
                 this call takes at most 100 bytes"
            );
            // The refused message's body never passes.
            assert!(passed < good + 5, "{cuts:?}: {passed}");
        }
        // Without the last one, all passes.
        let (passed, err) = read(&wire[..good], &[3, 110], cap);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(passed, good);
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(size_words(MIB), "1 MiB");
        assert_eq!(size_words(64 * KIB), "64 KiB");
        assert_eq!(size_words(14_000_016), "13.4 MiB");
        assert_eq!(size_words(900), "900 bytes");
    }

    #[test]
    fn caps_by_call_and_service() {
        assert_eq!(request_cap("/gpuctl.v1.Operator/SubmitJob"), MIB);
        assert_eq!(request_cap("/gpuctl.v1.Operator/ListJobs"), DEFAULT_CAP);
        assert_eq!(request_cap("/nope"), DEFAULT_CAP);
        assert_eq!(
            request_cap("/gpuctl.v1.RaftTransport/Step"),
            crate::raft::transport::MAX_RAFT_MESSAGE_BYTES
        );
        assert_eq!(service_cap("gpuctl.v1.Operator"), MIB);
        assert_eq!(service_cap("gpuctl.v1.AgentManager"), 20 * MIB);
        assert_eq!(service_cap("gpuctl.v1.Access"), DEFAULT_CAP);
        // Every listed call is a call of a service (a typo would leave
        // the call on the default cap).
        for (path, _) in CAPS {
            assert!(
                crate::service::auth::rule(path).is_some(),
                "{path} is no call"
            );
        }
    }
}
