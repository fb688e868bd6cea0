//! One leader-following client for gpuctl, the masters' web console and
//! the agent: the masters it knows, which one it talks to now, a lazy
//! channel to each, and one call's search for the leader. `leader` decides
//! (the hint, how a failure is classified, where to try next); this runs
//! the loop.
//!
//! Channels are made by an injected [`Connect`] closure (TLS or clear, the
//! endpoint's options), so this crate links no TLS of its own. Bearer
//! tokens are not the follower's business: a caller that has one puts it
//! on its requests (gpuctl's interceptor, the console's per-request
//! token), so channels shared between users never carry one.
//!
//! A [`Follower`] is used through `&self` and never holds its lock across
//! an `.await`, so tasks may share it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Status;

use crate::leader::{self, LeaderSearch, NextTry};

/// The longest one attempt of a read may take before the call moves on to
/// another master. A frozen leader (SIGSTOP, a hung machine) keeps its
/// connections open and silent until the others elect a new one (about an
/// election timeout): a read gives up on it after this, not after a
/// change's longer limit, and finds the new leader. Reads are small
/// (pages, bounded answers), so a master that answers at all answers well
/// within it.
pub const READ_ATTEMPT: Duration = Duration::from_secs(3);

/// Makes the lazy channel for one `HOST:PORT` (TLS or clear, endpoint
/// options). An error is the call's answer (a bad address).
pub type Connect = Arc<dyn Fn(&str) -> Result<Channel, Status> + Send + Sync>;

/// Changes when the client certificate changes: channels made before are
/// dropped, so new calls open a connection with the new certificate (the
/// master refuses calls on a connection whose certificate expired).
pub type Epoch = Arc<dyn Fn() -> u64 + Send + Sync>;

/// When a failed call may be sent again (to the leader, or later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A read: retried after any error that another master or a later try
    /// may not have.
    Always,
    /// A change that is safe to send again: idempotent, or a create that
    /// carries a request id, which the master dedupes. Retried like a
    /// read; from the first try that may have been applied on, the search
    /// for the leader lasts [`Policy::unknown_search_factor`] times longer,
    /// since giving up then leaves the outcome unknown.
    Resend,
}

/// How one client follows the leader.
#[derive(Clone, Copy)]
pub struct Policy {
    /// The pauses between tries that got no usable hint.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Under [`Retry::Resend`], how much longer the search goes on once a
    /// try may have been applied.
    pub unknown_search_factor: u32,
    /// Checks a hinted leader address (`None`: unusable).
    pub accept_hint: fn(&str) -> Option<String>,
    /// One channel per address, kept until a transport error (HTTP/2:
    /// calls share it); otherwise only the current address's channel,
    /// made again on every move.
    pub cache_channels: bool,
    /// Told before the pause when a call goes on to `next` after failing
    /// at the address with the status (the caller's log line).
    pub on_retry: fn(addr: &str, next: &NextTry, status: &Status),
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("backoff_min", &self.backoff_min)
            .field("backoff_max", &self.backoff_max)
            .field("unknown_search_factor", &self.unknown_search_factor)
            .field("cache_channels", &self.cache_channels)
            .finish_non_exhaustive()
    }
}

/// A call that did not succeed: the master's answer, or the last one when
/// no master could serve it in time.
#[derive(Debug)]
pub struct CallError {
    pub status: Status,
    /// The master that answered last (empty: there was no address).
    pub addr: String,
    /// The addresses known when the call ended (learned leaders included).
    pub tried: Vec<String>,
    /// `Some`: the search for the leader gave up, after looking this long
    /// (its deadline less its start, stretched under [`Retry::Resend`]);
    /// `None`: a master's own answer, another master would give it too.
    pub searched_for: Option<Duration>,
    /// Time from the start of the call to its end.
    pub elapsed: Duration,
    /// Some earlier try failed without proof that nothing was applied
    /// ([`leader::not_applied`]): for a change, its outcome is unknown.
    /// Computed under either [`Retry`]; the caller decides what it means.
    pub maybe_applied: bool,
}

/// What [`Follower::move_after`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    /// Another caller had already moved away from the failed address.
    Already,
    /// To the leader the failure named (added to the list if new).
    Redirected(String),
    /// To the next address (or stayed, with one address).
    Next,
}

impl Moved {
    /// Whether the next try may follow at once: a redirect, or another
    /// caller already moved.
    pub fn at_once(&self) -> bool {
        !matches!(self, Moved::Next)
    }
}

/// The masters a client knows, the one it talks to now, and channels to
/// them.
pub struct Follower {
    connect: Connect,
    epoch: Option<Epoch>,
    policy: Policy,
    state: Mutex<State>,
}

#[derive(Clone)]
struct State {
    /// The known addresses, and leaders learned from redirects.
    addrs: Vec<String>,
    /// The current one in `addrs`.
    index: usize,
    /// Channels by address (only the current one unless caching).
    channels: HashMap<String, Channel>,
    /// The [`Epoch`] the channels were made in.
    epoch: u64,
}

/// The map holds at most this many channels before it is emptied: masters
/// come and go with membership changes.
const MAX_CHANNELS: usize = 32;

impl Clone for Follower {
    /// An independent copy: the same connector and policy, a snapshot of
    /// the addresses and channels.
    fn clone(&self) -> Self {
        Follower {
            connect: self.connect.clone(),
            epoch: self.epoch.clone(),
            policy: self.policy,
            state: Mutex::new(self.lock().clone()),
        }
    }
}

impl std::fmt::Debug for Follower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("Follower")
            .field("addrs", &st.addrs)
            .field("current", &st.addrs.get(st.index))
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Follower {
    /// A follower of `addrs`, starting at the first.
    pub fn new(addrs: Vec<String>, connect: Connect, policy: Policy) -> Follower {
        Follower {
            connect,
            epoch: None,
            policy,
            state: Mutex::new(State {
                addrs,
                index: 0,
                channels: HashMap::new(),
                epoch: 0,
            }),
        }
    }

    /// Drops the channels whenever `epoch` changes (a new certificate).
    pub fn with_epoch(mut self, epoch: Epoch) -> Follower {
        self.epoch = Some(epoch);
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Talk to `addr` from now on over `channel`, a connection already
    /// made (gpuctl's first connection); `addr` joins the list if new.
    pub fn seed(&self, addr: &str, channel: Channel) {
        let mut st = self.lock();
        st.index = position_or_push(&mut st.addrs, addr);
        if !self.policy.cache_channels {
            st.channels.clear();
        }
        st.channels.insert(addr.to_string(), channel);
    }

    /// The address calls go to now (empty when none is known).
    pub fn current_addr(&self) -> String {
        let st = self.lock();
        st.addrs.get(st.index).cloned().unwrap_or_default()
    }

    /// Every known address.
    pub fn addrs(&self) -> Vec<String> {
        self.lock().addrs.clone()
    }

    /// Replaces the known addresses, keeping the current one (added first
    /// if the new list lacks it).
    pub fn set_addrs(&self, addrs: Vec<String>) {
        let mut st = self.lock();
        let current = st.addrs.get(st.index).cloned();
        st.addrs = addrs;
        st.index = match current {
            Some(c) => match st.addrs.iter().position(|a| *a == c) {
                Some(i) => i,
                None => {
                    st.addrs.insert(0, c);
                    0
                }
            },
            None => 0,
        };
    }

    /// The current address and its channel (made if absent; all channels
    /// dropped first when the epoch changed).
    pub fn current(&self) -> Result<(String, Channel), Status> {
        let mut st = self.lock_in_epoch();
        let addr = st.addrs.get(st.index).cloned().unwrap_or_default();
        if let Some(c) = st.channels.get(&addr) {
            return Ok((addr, c.clone()));
        }
        let channel = (self.connect)(&addr)?;
        self.keep(&mut st, &addr, channel.clone());
        Ok((addr, channel))
    }

    /// A channel to `addr`: the cached one, or a new one (cached when
    /// caching).
    pub fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let mut st = self.lock_in_epoch();
        if self.policy.cache_channels {
            if let Some(c) = st.channels.get(addr) {
                return Ok(c.clone());
            }
        }
        let channel = (self.connect)(addr)?;
        if self.policy.cache_channels {
            self.keep(&mut st, addr, channel.clone());
        }
        Ok(channel)
    }

    /// The state, its channels dropped first if the epoch changed since
    /// they were made (a renewed certificate needs new connections).
    fn lock_in_epoch(&self) -> MutexGuard<'_, State> {
        let epoch = self.epoch.as_ref().map(|e| e());
        let mut st = self.lock();
        if let Some(e) = epoch {
            if st.epoch != e {
                st.channels.clear();
                st.epoch = e;
            }
        }
        st
    }

    fn keep(&self, st: &mut State, addr: &str, channel: Channel) {
        if !self.policy.cache_channels || st.channels.len() > MAX_CHANNELS {
            st.channels.clear();
        }
        st.channels.insert(addr.to_string(), channel);
    }

    /// Talks to `addr` from now on (added to the list if new). Unless
    /// caching, over a new lazy channel: the connection is made by the next
    /// call, and if that fails the call fails before sending anything
    /// ([`leader::never_sent`]). An address the connector refuses changes
    /// nothing and is the error.
    pub fn switch_to(&self, addr: &str) -> Result<(), Status> {
        let cached = self.policy.cache_channels && self.lock().channels.contains_key(addr);
        let channel = if cached {
            None
        } else {
            Some((self.connect)(addr)?)
        };
        let mut st = self.lock();
        st.index = position_or_push(&mut st.addrs, addr);
        if let Some(channel) = channel {
            self.keep(&mut st, addr, channel);
        }
        Ok(())
    }

    /// Drops the channel to `addr`: the next call makes a new one.
    pub fn forget(&self, addr: &str) {
        self.lock().channels.remove(addr);
    }

    /// After a call to `failed` failed (with `status`, if any): only the
    /// first caller that failed at the current address moves it, to the
    /// leader the status names when [`Policy::accept_hint`] takes the hint
    /// (added to the list if new), else to the next address; the channel
    /// is dropped when the current address changes. No backoff and no
    /// list of masters that refused here: the caller paces its tries.
    pub fn move_after(&self, failed: &str, status: Option<&Status>) -> Moved {
        let mut st = self.lock();
        if st.addrs.get(st.index).map(String::as_str) != Some(failed) {
            return Moved::Already;
        }
        let st = &mut *st;
        let (index, redirected) = next_index(&mut st.addrs, st.index, status, |h| {
            (self.policy.accept_hint)(h)
        });
        if index != st.index {
            st.index = index;
            st.channels.remove(failed);
        }
        if redirected {
            Moved::Redirected(st.addrs.get(index).cloned().unwrap_or_default())
        } else {
            Moved::Next
        }
    }

    /// One call: `f` on a channel to the current master, following the
    /// leader's redirects and moving on while the failure may pass
    /// elsewhere ([`leader::may_retry`]), until it succeeds, fails with the
    /// master's own answer, or `deadline` would pass before the next try.
    /// Each try is bounded by `attempt` (`None`: a stream that may take
    /// long to open). The current address follows the search: the next
    /// call starts where this one ended.
    pub async fn call<T, F, Fut>(
        &self,
        retry: Retry,
        attempt: Option<Duration>,
        deadline: Instant,
        f: F,
    ) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let addrs = self.addrs();
        let addr = self.current_addr();
        self.run(true, addrs, addr, retry, attempt, deadline, f)
            .await
    }

    /// [`Follower::call`] among `addrs` (best first), read afresh for this
    /// call; leaders learned join them for this call only, and the
    /// follower's current address does not move.
    pub async fn call_among<T, F, Fut>(
        &self,
        addrs: Vec<String>,
        retry: Retry,
        attempt: Option<Duration>,
        deadline: Instant,
        f: F,
    ) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let Some(addr) = addrs.first().cloned() else {
            return Err(CallError {
                status: Status::unavailable("no master address is known"),
                addr: String::new(),
                tried: Vec::new(),
                searched_for: None,
                elapsed: Duration::ZERO,
                maybe_applied: false,
            });
        };
        self.run(false, addrs, addr, retry, attempt, deadline, f)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn run<T, F, Fut>(
        &self,
        sticky: bool,
        mut addrs: Vec<String>,
        mut addr: String,
        retry: Retry,
        attempt: Option<Duration>,
        deadline: Instant,
        mut f: F,
    ) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        let mut deadline = deadline;
        let mut search = LeaderSearch::new(self.policy.backoff_min, self.policy.backoff_max);
        let mut maybe_applied = false;
        let error = |status, addr, tried, searched_for, maybe_applied| CallError {
            status,
            addr,
            tried,
            searched_for,
            elapsed: started.elapsed(),
            maybe_applied,
        };
        loop {
            let channel = if sticky {
                self.current().map(|(a, c)| {
                    addr = a;
                    c
                })
            } else {
                self.channel(&addr)
            };
            let result = match channel {
                Ok(channel) => {
                    let call = f(channel);
                    match attempt {
                        Some(limit) => {
                            tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
                                Err(Status::deadline_exceeded(format!(
                                    "master {addr} did not answer within {}s",
                                    limit.as_secs_f64()
                                )))
                            })
                        }
                        None => call.await,
                    }
                }
                Err(status) => Err(status),
            };
            let status = match result {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => status,
            };
            if sticky {
                addrs = self.addrs();
            }
            if !leader::may_retry(&status) {
                // The master's own answer: definite for this try, not for
                // the earlier ones.
                return Err(error(status, addr, addrs, None, maybe_applied));
            }
            if !maybe_applied && !leader::not_applied(&status) {
                maybe_applied = true;
                if retry == Retry::Resend {
                    let searched = deadline.saturating_duration_since(started);
                    deadline = started + searched * self.policy.unknown_search_factor;
                }
            }
            if self.policy.cache_channels && leader::is_transport_error(&status) {
                // A broken connection is made again by the next try.
                self.forget(&addr);
            }
            let next = search.next(&addr, &status, &addrs, self.policy.accept_hint);
            if Instant::now() + next.pause >= deadline {
                let searched = deadline.saturating_duration_since(started);
                return Err(error(status, addr, addrs, Some(searched), maybe_applied));
            }
            (self.policy.on_retry)(&addr, &next, &status);
            tokio::time::sleep(next.pause).await;
            if sticky {
                // An address the connector refuses (only an unchecked hint
                // can be one) leaves the current one.
                let _ = self.switch_to(&next.addr);
            } else {
                if next.redirected && !addrs.contains(&next.addr) {
                    addrs.push(next.addr.clone());
                }
                addr = next.addr;
            }
        }
    }
}

/// `addr`'s index in `addrs`, added at the end if new.
fn position_or_push(addrs: &mut Vec<String>, addr: &str) -> usize {
    match addrs.iter().position(|a| a == addr) {
        Some(i) => i,
        None => {
            addrs.push(addr.to_string());
            addrs.len() - 1
        }
    }
}

/// Where to go after a call to `addrs[current]` failed with `status`: to
/// the leader the status names, when `accept_hint` takes it and it is not
/// the current address (added to `addrs` if new), else to the next
/// address round the list. Returns the new index and whether it followed a
/// redirect.
pub fn next_index(
    addrs: &mut Vec<String>,
    current: usize,
    status: Option<&Status>,
    accept_hint: impl Fn(&str) -> Option<String>,
) -> (usize, bool) {
    let current_addr = addrs.get(current).map(String::as_str);
    let hint = status
        .and_then(leader::leader_hint)
        .and_then(|h| accept_hint(&h))
        .filter(|h| Some(h.as_str()) != current_addr);
    if let Some(leader) = hint {
        return (position_or_push(addrs, &leader), true);
    }
    if addrs.is_empty() {
        return (0, false);
    }
    ((current + 1) % addrs.len(), false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memnet::Net;
    use crate::pb;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use tonic::{Code, Request, Response};

    /// A master's Access service: WhoAmI answers with the master's name,
    /// redirects, or fails like a leader deposed mid-commit.
    #[derive(Clone)]
    enum Role {
        Leader(&'static str),
        Follower(Option<String>),
        Ambiguous,
    }

    struct Fake(Role);

    type Answer<T> = Result<Response<T>, Status>;

    #[tonic::async_trait]
    impl pb::access_server::Access for Fake {
        async fn who_am_i(&self, _: Request<pb::WhoAmIRequest>) -> Answer<pb::WhoAmIResponse> {
            match &self.0 {
                Role::Leader(name) => Ok(Response::new(pb::WhoAmIResponse {
                    kind: name.to_string(),
                    ..Default::default()
                })),
                Role::Follower(hint) => Err(leader::not_leader(hint.as_deref().map(|h| (1, h)))),
                Role::Ambiguous => Err(Status::unavailable("leadership lost while committing")),
            }
        }
        async fn create_token(
            &self,
            _: Request<pb::CreateTokenRequest>,
        ) -> Answer<pb::CreateTokenResponse> {
            Err(Status::unimplemented(""))
        }
        async fn list_tokens(
            &self,
            _: Request<pb::ListTokensRequest>,
        ) -> Answer<pb::ListTokensResponse> {
            Err(Status::unimplemented(""))
        }
        async fn revoke_token(&self, _: Request<pb::RevokeTokenRequest>) -> Answer<pb::TokenInfo> {
            Err(Status::unimplemented(""))
        }
        async fn set_quota(&self, _: Request<pb::SetQuotaRequest>) -> Answer<pb::TenantQuota> {
            Err(Status::unimplemented(""))
        }
        async fn list_quotas(
            &self,
            _: Request<pb::ListQuotasRequest>,
        ) -> Answer<pb::ListQuotasResponse> {
            Err(Status::permission_denied("not for you"))
        }
    }

    /// Serves `role` at `addr` on `net`: in-memory pipes, so the tests
    /// run on tokio's paused clock and timings are exact.
    fn serve(net: &Arc<Net>, addr: &str, role: Role) -> String {
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::access_server::AccessServer::new(Fake(role)))
                .serve_with_incoming(net.listen(addr)),
        );
        addr.to_string()
    }

    /// A connector on `net` that counts the channels it makes.
    fn connector(net: &Arc<Net>, made: Arc<AtomicUsize>) -> Connect {
        let connect = net.connect();
        Arc::new(move |addr: &str| {
            made.fetch_add(1, Ordering::SeqCst);
            connect(addr)
        })
    }

    fn policy(cache_channels: bool) -> Policy {
        Policy {
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_millis(200),
            unknown_search_factor: 4,
            accept_hint: |h| Some(h.to_string()),
            cache_channels,
            on_retry: |_, _, _| {},
        }
    }

    fn follower(net: &Arc<Net>, addrs: &[&String], cache: bool) -> (Follower, Arc<AtomicUsize>) {
        let made = Arc::new(AtomicUsize::new(0));
        let addrs = addrs.iter().map(|a| a.to_string()).collect();
        (
            Follower::new(addrs, connector(net, made.clone()), policy(cache)),
            made,
        )
    }

    async fn who(f: &Follower, retry: Retry, within: Duration) -> Result<String, CallError> {
        let r = f
            .call(
                retry,
                Some(Duration::from_secs(2)),
                Instant::now() + within,
                |c| async move {
                    pb::access_client::AccessClient::new(c)
                        .who_am_i(pb::WhoAmIRequest {})
                        .await
                },
            )
            .await?;
        Ok(r.kind)
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_follows_the_hint_and_stays_with_the_leader() {
        let net = Net::new();
        let leader = serve(&net, "m1:7050", Role::Leader("leader"));
        let follower_addr = serve(&net, "m2:7050", Role::Follower(Some(leader.clone())));
        let (f, _) = follower(&net, &[&follower_addr], false);
        let within = Duration::from_secs(5);
        assert_eq!(who(&f, Retry::Always, within).await.unwrap(), "leader");
        assert_eq!(f.current_addr(), leader);
        assert_eq!(f.addrs(), vec![follower_addr.clone(), leader.clone()]);
        // A master's own answer is the call's: not retried, no search.
        let e = f
            .call(
                Retry::Always,
                None,
                Instant::now() + within,
                |c| async move {
                    pb::access_client::AccessClient::new(c)
                        .list_quotas(pb::ListQuotasRequest {})
                        .await
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.status.code(), Code::PermissionDenied);
        assert_eq!((e.addr.as_str(), e.searched_for), (leader.as_str(), None));
        assert!(!e.maybe_applied);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_moves_on_after_a_transport_error() {
        let net = Net::new();
        let leader = serve(&net, "m1:7050", Role::Leader("leader"));
        // Nobody listens there: the connection is refused.
        let down = "m2:7050".to_string();
        let (f, _) = follower(&net, &[&down, &leader], false);
        let within = Duration::from_secs(5);
        assert_eq!(who(&f, Retry::Resend, within).await.unwrap(), "leader");
        assert_eq!(f.current_addr(), leader);
        // Among addresses given per call, with cached channels: the
        // current address does not move, the broken channel is dropped.
        let (f, made) = follower(&net, &[], true);
        let r = f
            .call_among(
                vec![down.clone(), leader.clone()],
                Retry::Always,
                Some(Duration::from_secs(2)),
                Instant::now() + within,
                |c| async move {
                    pb::access_client::AccessClient::new(c)
                        .who_am_i(pb::WhoAmIRequest {})
                        .await
                },
            )
            .await
            .unwrap();
        assert_eq!(r.kind, "leader");
        assert_eq!(f.current_addr(), "");
        assert_eq!(made.load(Ordering::SeqCst), 2);
        assert!(f.channel(&leader).is_ok());
        assert_eq!(
            made.load(Ordering::SeqCst),
            2,
            "the leader's channel is kept"
        );
        assert!(f.channel(&down).is_ok());
        assert_eq!(made.load(Ordering::SeqCst), 3, "the broken one was dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_gives_up_at_its_deadline_with_the_span() {
        let net = Net::new();
        let a = serve(&net, "m1:7050", Role::Follower(None));
        let b = serve(&net, "m2:7050", Role::Follower(None));
        let (f, _) = follower(&net, &[&a, &b], false);
        let within = Duration::from_millis(600);
        let started = Instant::now();
        let e = who(&f, Retry::Resend, within).await.unwrap_err();
        // No hint: pauses of 50, 100, 200, 200 ms (the policy's backoff);
        // the next 200 would end past the deadline, so the call ends at
        // 550 ms instead of sleeping into it.
        assert_eq!(started.elapsed(), Duration::from_millis(550));
        assert_eq!(e.elapsed, Duration::from_millis(550), "{e:?}");
        assert_eq!(e.status.code(), Code::Unavailable);
        assert!(e.status.message().contains("no leader is elected"), "{e:?}");
        // The span is the deadline's, exactly: what the caller asked for.
        assert_eq!(e.searched_for, Some(within));
        assert_eq!(e.tried, vec![a.clone(), b.clone()]);
        // Five tries round two masters end at the first.
        assert_eq!(e.addr, a);
        // A redirect refuses before proposing: nothing was applied.
        assert!(!e.maybe_applied);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ambiguous_failure_may_be_applied_and_stretches_a_resend() {
        let net = Net::new();
        let a = serve(&net, "m1:7050", Role::Ambiguous);
        let within = Duration::from_millis(300);
        let (f, _) = follower(&net, &[&a], false);
        // A read searches as long as asked: 50 + 100 ms of pauses, the
        // next 200 would pass 300.
        let e = who(&f, Retry::Always, within).await.unwrap_err();
        assert!(e.maybe_applied);
        assert_eq!(e.searched_for, Some(within));
        assert_eq!(e.elapsed, Duration::from_millis(150));
        // A resend whose first try may have been applied searches four
        // times as long (the policy's factor): 1200 ms, pauses of 50, 100,
        // then 200 until the next would pass it (at 1150).
        let started = Instant::now();
        let e = who(&f, Retry::Resend, within).await.unwrap_err();
        assert!(e.maybe_applied);
        assert_eq!(e.searched_for, Some(within * 4));
        assert_eq!(e.elapsed, Duration::from_millis(1150));
        assert_eq!(started.elapsed(), e.elapsed);
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_first_caller_to_fail_moves_and_hints_are_checked() {
        let list: Vec<String> = ["m1:7050", "m2:7050", "m3:7050"].map(String::from).to_vec();
        let made = Arc::new(AtomicUsize::new(0));
        let net = Net::new();
        let mut p = policy(false);
        p.accept_hint = leader::host_port;
        let f = Follower::new(list.clone(), connector(&net, made.clone()), p);
        assert_eq!(f.current().unwrap().0, "m1:7050");
        assert_eq!(made.load(Ordering::SeqCst), 1);
        assert_eq!(f.move_after("m1:7050", None), Moved::Next);
        assert_eq!(f.current_addr(), "m2:7050");
        // Another task's failure at m1 is old news.
        assert_eq!(f.move_after("m1:7050", None), Moved::Already);
        assert!(Moved::Already.at_once() && !Moved::Next.at_once());
        assert_eq!(f.current_addr(), "m2:7050");
        let s = leader::not_leader(Some((3, " m3:7050 ")));
        assert_eq!(
            f.move_after("m2:7050", Some(&s)),
            Moved::Redirected("m3:7050".into())
        );
        assert_eq!(f.current().unwrap().0, "m3:7050");
        assert_eq!(made.load(Ordering::SeqCst), 2, "a new channel after a move");
        // A hint that is not HOST:PORT, or names the failed master, is none.
        for bad in ["nonsense", "m9:0", "http://m9:7050/x", "m3:7050"] {
            let s = leader::not_leader(Some((1, bad)));
            let mut addrs = list.clone();
            assert_eq!(
                next_index(&mut addrs, 2, Some(&s), leader::host_port),
                (0, false),
                "{bad}"
            );
            assert_eq!(addrs, list);
        }
        // An unknown leader joins the list.
        let mut addrs = list.clone();
        let s = leader::not_leader(Some((4, "m4:7050")));
        assert_eq!(
            next_index(&mut addrs, 0, Some(&s), leader::host_port),
            (3, true)
        );
        assert_eq!(addrs.len(), 4);
        // With one address a failure stays there and keeps the channel.
        let one = Follower::new(vec!["m1:7050".into()], connector(&net, made.clone()), p);
        one.current().unwrap();
        let before = made.load(Ordering::SeqCst);
        assert_eq!(one.move_after("m1:7050", None), Moved::Next);
        one.current().unwrap();
        assert_eq!(made.load(Ordering::SeqCst), before);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_epoch_makes_a_new_channel() {
        let made = Arc::new(AtomicUsize::new(0));
        let epoch = Arc::new(AtomicU64::new(1));
        let e = epoch.clone();
        let f = Follower::new(
            vec!["m1:7050".into()],
            connector(&Net::new(), made.clone()),
            policy(false),
        )
        .with_epoch(Arc::new(move || e.load(Ordering::SeqCst)));
        f.current().unwrap();
        f.current().unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 1);
        epoch.store(2, Ordering::SeqCst);
        f.current().unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_epoch_drops_cached_channels_too() {
        // The console's way: a channel per master, cached.
        let made = Arc::new(AtomicUsize::new(0));
        let epoch = Arc::new(AtomicU64::new(1));
        let e = epoch.clone();
        let f = Follower::new(
            Vec::new(),
            connector(&Net::new(), made.clone()),
            policy(true),
        )
        .with_epoch(Arc::new(move || e.load(Ordering::SeqCst)));
        f.channel("m1:7050").unwrap();
        f.channel("m1:7050").unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 1, "cached");
        epoch.store(2, Ordering::SeqCst);
        f.channel("m1:7050").unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 2, "made again after a renewal");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_address_changes_nothing() {
        let (f, made) = follower(&Net::new(), &[&"m1:7050".to_string()], false);
        let e = f.switch_to("bad address with spaces:1").unwrap_err();
        assert!(e.message().contains("master address"), "{e:?}");
        assert_eq!(f.addrs(), vec!["m1:7050".to_string()]);
        f.switch_to("m2:7050").unwrap();
        assert_eq!(f.current_addr(), "m2:7050");
        assert_eq!(made.load(Ordering::SeqCst), 2);
        f.set_addrs(vec!["m0:7050".into()]);
        assert_eq!(
            f.addrs(),
            vec!["m2:7050".to_string(), "m0:7050".to_string()]
        );
        assert_eq!(f.current_addr(), "m2:7050");
    }
}
