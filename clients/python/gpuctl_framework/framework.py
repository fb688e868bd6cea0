"""A framework of gpuctl's framework API (docs/framework-api.md).

`Framework` subscribes at the leading master, yields the events of its
stream, and makes the calls (Accept, Decline, Acknowledge, ...) at the master
it is subscribed at. Only the Raft leader serves the API: a follower answers
UNAVAILABLE and names the leader in the `gpuctl-leader` response metadata
when it knows it. When the stream breaks, falls silent, or a call is
redirected, the framework subscribes again at the leader WITH its framework
id: a failover, which keeps its tasks and makes the agents resend the
updates not yet acknowledged.

    fw = Framework(["m1:7050", "m2:7050"], name="demo")
    for event in fw.events():
        kind = event.WhichOneof("event")
        if kind == "offers":
            ...  # fw.accept(...) or fw.decline(...)
        elif kind == "update":
            ...
            fw.acknowledge(event.update)
"""

import logging
import os
import queue
import threading
import time

import grpc

from . import scheduler_pb2 as pb
from . import scheduler_pb2_grpc

log = logging.getLogger("gpuctl_framework")

# Metadata of an UNAVAILABLE answer: the leader's API address (HOST:PORT).
LEADER_METADATA = "gpuctl-leader"
# Metadata present when the master refused a call before proposing anything,
# so nothing of it happened (an Accept launched nothing).
NOT_PROPOSED_METADATA = "gpuctl-not-proposed"

# The stream counts as dead after this many heartbeat intervals of silence.
MISSED_HEARTBEATS = 3.0
# How long a stream may stay silent before its first event (SUBSCRIBED
# then tells the heartbeat interval).
FIRST_EVENT_TIMEOUT = 30.0
# Redirects followed in one round, beyond one try per address.
FREE_REDIRECTS = 3
# The end of an event stream, as the pump thread reports it.
_END = object()


class FrameworkError(Exception):
    """The framework cannot go on (not a transient failure)."""


class FrameworkRemoved(FrameworkError):
    """The master ended the framework for good: an ERROR event (torn down,
    failover timeout passed, another connection subscribed with its id, or it
    sent something the master cannot accept), or a re-subscription refused
    because the framework is removed or unknown. Not retried."""


class NoMaster(FrameworkError):
    """No master accepted the subscription within `subscribe_patience`."""


def metadata(err, key):
    """The value of `key` in an RpcError's trailing or initial metadata."""
    for get in ("trailing_metadata", "initial_metadata"):
        for k, v in (getattr(err, get, lambda: None)() or ()):
            if k == key:
                return v.decode() if isinstance(v, bytes) else v
    return None


def leader_hint(err):
    """The leader's HOST:PORT that a redirect (UNAVAILABLE) names, or None."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    hint = metadata(err, LEADER_METADATA)
    host, _, port = (hint or "").rpartition(":")
    # A bad hint must not join the list of masters.
    if host and "/" not in host and port.isdigit() and 0 < int(port) < 65536:
        return hint
    return None


def not_proposed(err):
    """Whether the master refused the call before proposing it: it did
    nothing, so the call may be sent again (at the leader)."""
    return metadata(err, NOT_PROPOSED_METADATA) is not None


class Framework:
    """One framework, subscribed at the leader of `masters`.

    masters: ["host:port", ...] or "host:port,host:port"; the leader is found
        among them (and followed if a redirect names another address).
    roles, capabilities, failover_timeout: its FrameworkInfo. The master
        keeps a disconnected framework's tasks for `failover_timeout` s.
    framework_id: to re-attach to an existing framework (its tasks).
    auto_acknowledge: acknowledge every update that carries a uuid once the
        caller has handled it (when it asks events() for the next event).
        Off by default: call acknowledge(update) yourself.
    call_timeout: the deadline of each call, and how long a Subscribe may
        take to answer (SUBSCRIBED) before the next master is tried.
    subscribe_patience: give up (NoMaster) when no master has taken the
        subscription for this long (an election takes a few seconds).

    Calls may be made from any thread; events() is meant for one.
    """

    def __init__(self, masters, name, roles=("default",),
                 capabilities=(pb.GPU_RESOURCES,), failover_timeout=60.0,
                 framework_id="", auto_acknowledge=False, call_timeout=15.0,
                 subscribe_patience=60.0, backoff=1.0, tls_dir=None,
                 token=None):
        if isinstance(masters, str):
            masters = masters.split(",")
        self.masters = [m.strip() for m in masters if m.strip()]
        if not self.masters:
            raise ValueError("no master address given")
        self.info = pb.FrameworkInfo(
            id=framework_id, name=name, roles=list(roles),
            capabilities=list(capabilities),
            failover_timeout_secs=failover_timeout)
        self.auto_acknowledge = auto_acknowledge
        # The idempotency key of this framework's first subscription, sent
        # with every retry: one whose SUBSCRIBED never came re-attaches to
        # the framework it made instead of registering a second (ignored
        # once the framework has its id).
        self.request_id = os.urandom(16).hex()
        self._credentials = _credentials(tls_dir, token)
        self.call_timeout = call_timeout
        self.subscribe_patience = subscribe_patience
        self.backoff = backoff
        self._lock = threading.Lock()
        self._current = 0          # index in masters of the one we use
        self._channel = None
        self._stub = None          # calls go to the master we subscribed at
        self._call = None          # the Subscribe call (the event stream)
        self._resubscribe = False  # end this stream and subscribe again
        self._closed = False
        # Restated at each subscription: the master keeps suppression in
        # the leader's memory only, so a new leader learns it from us.
        self._suppressed = False

    @property
    def framework_id(self):
        """Our id, set by the first SUBSCRIBED ("" before it)."""
        return self.info.id

    # -- the event stream ---------------------------------------------------

    def events(self):
        """Subscribes and yields each Event (scheduler_pb2.Event), including
        SUBSCRIBED (again after each re-subscription) and HEARTBEAT.

        Re-subscribes with the framework id whenever the stream is lost and,
        after a re-subscription, asks for an implicit reconciliation (the
        latest state of every task not yet ended). Offers of a lost stream
        are gone: wait for new ones. Ends after teardown() or close().
        Raises FrameworkRemoved on an ERROR event, NoMaster when no master
        takes the subscription within subscribe_patience.
        """
        while not self._closed:
            subscribed = self._subscribe()
            if subscribed is None:
                return
            first, events = subscribed
            silence = None  # until SUBSCRIBED gives the heartbeat interval
            started = time.monotonic()
            while not self._closed:
                if first is not None:
                    item, first = first, None
                else:
                    try:
                        item = events.get(timeout=silence or FIRST_EVENT_TIMEOUT)
                    except queue.Empty:
                        log.warning("no event from %s for %.0f s; subscribing again",
                                    self._master(), silence or FIRST_EVENT_TIMEOUT)
                        break
                if item is _END or not isinstance(item, pb.Event):
                    # After a redirect, the call already chose the master.
                    if not self._closed and not self._resubscribe:
                        self._stream_lost(item)
                    break
                kind = item.WhichOneof("event")
                if kind == "subscribed":
                    again = bool(self.info.id)
                    self.info.id = item.subscribed.framework_id
                    interval = item.subscribed.heartbeat_interval_secs
                    silence = interval * MISSED_HEARTBEATS if interval > 0 else None
                    if again:
                        self._try(self.reconcile)
                elif kind == "error":
                    if self._closed:
                        return  # our own teardown(), seen from another thread
                    self.close()
                    raise FrameworkRemoved("the master ended framework %s: %s"
                                           % (self.info.id, item.error))
                yield item
                if (kind == "update" and self.auto_acknowledge and item.update.uuid
                        and not self._closed and not self._try(self.acknowledge, item.update)):
                    # The master forwards an update once per subscription:
                    # only a new one brings it back, to be acknowledged then.
                    self.resubscribe()
                if self._resubscribe:
                    log.warning("leaving the stream at %s; subscribing again", self._master())
                    break
            self._drop_channel()
            # A stream that ends at once must not make a busy loop.
            time.sleep(max(0.0, self.backoff - (time.monotonic() - started)))

    def _subscribe(self):
        """Subscribes, starting at the current master: follows the leader a
        redirect names, else tries the next address, round after round with
        a backoff. Returns the stream's first event (SUBSCRIBED) and the
        queue of the others, or None once closed."""
        deadline = time.monotonic() + self.subscribe_patience
        last = "no attempt"
        while not self._closed:
            down = set()
            for _ in range(len(self.masters) + FREE_REDIRECTS):
                addr = self.masters[self._current]
                with self._lock:
                    self._resubscribe = False
                    self._connect(addr)
                    call = self._stub.Subscribe(pb.SubscribeRequest(
                        framework=self.info, suppressed=self._suppressed,
                        request_id=self.request_id))
                    self._call = call
                events = queue.Queue()
                threading.Thread(target=_pump, args=(call, events),
                                 name="gpuctl-events", daemon=True).start()
                try:
                    first = events.get(timeout=self.call_timeout)
                except queue.Empty:
                    first = "no answer within %.0f s" % self.call_timeout
                if isinstance(first, pb.Event):
                    log.info("subscribed at %s", addr)
                    return first, events
                # A fresh channel next time: a failed one waits out gRPC's
                # reconnect backoff (up to minutes) before it tries again.
                self._drop_channel()
                if self._closed:
                    return None
                hint = None
                if isinstance(first, grpc.RpcError):
                    last = "%s: %s: %s" % (addr, first.code().name, first.details())
                    self._refused(first)
                    hint = leader_hint(first)
                    if not hint and not not_proposed(first):
                        down.add(addr)  # no master answered there
                else:
                    last = "%s: %s" % (addr, "stream ended" if first is _END else first)
                # Followers may still name a leader that just died.
                if hint and hint not in down:
                    log.info("%s is not the leader; redirected to %s", addr, hint)
                    self._next_master(first)
                else:
                    self._next_master(None)
            if time.monotonic() + self.backoff > deadline:
                raise NoMaster("could not subscribe at any master (%s) within %.0f s; last: %s"
                               % (",".join(self.masters), self.subscribe_patience, last))
            log.info("no master took the subscription (%s); retrying", last)
            time.sleep(self.backoff)
        return None

    def _refused(self, err):
        """Raises when a Subscribe refusal is final (not worth another master)."""
        code = err.code()
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND) and self.info.id:
            self.close()
            raise FrameworkRemoved("cannot re-subscribe as %s: %s" % (self.info.id, err.details()))
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNIMPLEMENTED):
            self.close()
            raise FrameworkError("Subscribe refused: %s: %s" % (code.name, err.details()))

    def _stream_lost(self, item):
        """The stream ended or failed: log it, and go to the leader it names."""
        if item is _END:
            log.warning("%s closed the event stream", self._master())
            self._next_master(None)
        else:
            log.warning("event stream at %s: %s: %s", self._master(), item.code().name, item.details())
            self._next_master(item if leader_hint(item) else None)

    # -- calls --------------------------------------------------------------

    def accept(self, offer_ids, tasks=(), group=False, operations=(), refuse_seconds=None):
        """Uses offers: LAUNCHes `tasks` (TaskInfo, see tasks.task_info), or
        with group=True launches them as one LAUNCH_GROUP (all or none);
        `operations` adds Operation messages as they are. What is not used
        is declined, not offered again for `refuse_seconds` (master default
        5 s). All or nothing: a refused call (grpc.RpcError) launched nothing
        and leaves the offers outstanding, except an UNAVAILABLE without
        not_proposed(err), after which it is unknown whether the tasks were
        launched (reconcile them once subscribed again)."""
        ops = list(operations)
        if tasks:
            launch = pb.Launch(tasks=list(tasks))
            ops.append(pb.Operation(launch_group=launch) if group else pb.Operation(launch=launch))
        self._rpc("Accept", pb.AcceptRequest(
            framework_id=self.info.id, offer_ids=_ids(offer_ids), operations=ops,
            filters=_filters(refuse_seconds)))

    def decline(self, offer_ids, refuse_seconds=None):
        """Gives offers back; their agents are not offered to this framework
        again for `refuse_seconds` (master default 5 s)."""
        self._rpc("Decline", pb.DeclineRequest(
            framework_id=self.info.id, offer_ids=_ids(offer_ids),
            filters=_filters(refuse_seconds)))

    def acknowledge(self, update):
        """Confirms an UPDATE (a TaskStatus): the agent holds the task's next
        update until then. Updates without a uuid (the master's own,
        reconciliation answers) need none and are skipped. If it fails,
        call resubscribe() (done already after UNAVAILABLE): the master
        forwards the update again only to a new subscription."""
        if not update.uuid:
            return
        self._rpc("Acknowledge", pb.AcknowledgeRequest(
            framework_id=self.info.id, agent_id=update.agent_id,
            task_id=update.task_id, uuid=update.uuid))

    def kill(self, task_id):
        """Kills a task (SIGTERM, then SIGKILL after the agent's grace)."""
        self._rpc("Kill", pb.KillRequest(framework_id=self.info.id, task_id=task_id))

    def reconcile(self, tasks=()):
        """Asks for UPDATEs with the latest state of `tasks` ((task_id,
        agent_id) pairs or TaskStatus), or of every task not yet ended when
        empty. A task the master does not know is answered LOST."""
        wanted = [pb.ReconcileTask(task_id=t.task_id, agent_id=t.agent_id)
                  if hasattr(t, "task_id") else pb.ReconcileTask(task_id=t[0], agent_id=t[1])
                  for t in tasks]
        self._rpc("Reconcile", pb.ReconcileRequest(framework_id=self.info.id, tasks=wanted))

    def suppress(self, roles=None):
        """Stops offers until revive(), across re-subscriptions and
        failovers too (the client restates it when it subscribes)."""
        self._rpc("Suppress", pb.SuppressRequest(
            framework_id=self.info.id, roles=list(self.info.roles if roles is None else roles)))
        self._suppressed = True

    def revive(self, roles=None):
        """Clears this framework's filters and resumes offers."""
        self._rpc("Revive", pb.ReviveRequest(
            framework_id=self.info.id, roles=list(self.info.roles if roles is None else roles)))
        self._suppressed = False

    def resubscribe(self):
        """Ends the current stream: events() subscribes again, with the
        framework id. The master then resends at once every update not yet
        acknowledged (on the same stream it resends them too, after
        --update-resend-secs, doubling)."""
        with self._lock:
            self._resubscribe = True
            if self._call is not None:
                self._call.cancel()

    def teardown(self, timeout=10.0):
        """Removes the framework: the master kills its tasks and forgets it.
        Looks for the leader if our master no longer leads: left behind, the
        tasks would run until the failover timeout. Ends events(). A
        framework already removed counts as done. Raises grpc.RpcError if no
        master took it within `timeout`."""
        self._closed = True
        try:
            if not self.info.id:
                return
            deadline = time.monotonic() + timeout
            while True:
                addr = self.masters[self._current]
                try:
                    with self._lock:
                        if self._stub is None:
                            self._connect(addr)
                        stub = self._stub
                    stub.Teardown(pb.TeardownRequest(framework_id=self.info.id),
                                  timeout=max(0.1, min(self.call_timeout, deadline - time.monotonic())))
                    log.info("framework %s torn down at %s", self.info.id, addr)
                    return
                except grpc.RpcError as err:
                    if err.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.NOT_FOUND):
                        # Removed already (an earlier Teardown, the failover
                        # timeout) or never known: nothing left to remove.
                        log.info("teardown: %s", err.details())
                        return
                    # Not the leader (now), or gone: ask another master.
                    if err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    if time.monotonic() + 0.2 > deadline:
                        raise
                    self._next_master(err)
                    with self._lock:
                        self._disconnect()
                    if not leader_hint(err):
                        time.sleep(0.2)
        finally:
            self.close()

    def close(self):
        """Disconnects without tearing down: the master keeps the tasks for
        the failover timeout, and Framework(..., framework_id=...) may
        re-attach. Ends events()."""
        self._closed = True
        with self._lock:
            self._disconnect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- plumbing -----------------------------------------------------------

    def _rpc(self, method, request):
        with self._lock:
            stub = self._stub
        if stub is None or not self.info.id:
            raise FrameworkError("not subscribed: %s needs a subscription" % method)
        try:
            getattr(stub, method)(request, timeout=self.call_timeout)
        except ValueError as err:  # events() dropped the channel meanwhile
            raise FrameworkError("not subscribed (subscribing again): %s" % err) from err
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                # Our master no longer leads (or is gone): our stream is
                # stale. Subscribe again, at the leader it names if any.
                with self._lock:
                    if leader_hint(err):
                        self._next_master(err)
                self.resubscribe()
            raise

    def _try(self, call, *args):
        """A call made on the framework's own behalf: failures are logged.
        Returns whether it succeeded."""
        try:
            call(*args)
            return True
        except (grpc.RpcError, FrameworkError) as err:
            log.warning("%s failed: %s", call.__name__,
                        err.details() if isinstance(err, grpc.RpcError) else err)
            return False

    def _master(self):
        return self.masters[self._current]

    def _next_master(self, err):
        """Moves to the leader that `err` names (added to masters if new),
        else to the next address."""
        hint = leader_hint(err) if err is not None else None
        if hint and hint != self.masters[self._current]:
            if hint not in self.masters:
                self.masters.append(hint)
            self._current = self.masters.index(hint)
        else:
            self._current = (self._current + 1) % len(self.masters)

    def _connect(self, addr):
        """Points the stub at a new channel to `addr` (lock held)."""
        self._disconnect()
        if self._credentials is None:
            self._channel = grpc.insecure_channel(addr)
        else:
            # The master's certificate names its role, not its host.
            self._channel = grpc.secure_channel(
                addr, self._credentials,
                options=[("grpc.ssl_target_name_override", MASTER_SERVER_NAME)])
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def _disconnect(self):
        """Cancels the stream and closes the channel (lock held)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _drop_channel(self):
        with self._lock:
            self._disconnect()


MASTER_SERVER_NAME = "master.gpuctl"


def _credentials(tls_dir, token):
    """Channel credentials for a cluster with TLS (docs/security.md):
    tls_dir holds ca.crt, client.crt and client.key; the token goes in
    every call's `authorization: Bearer` header. None without tls_dir."""
    if tls_dir is None:
        if token:
            raise ValueError("a token needs tls_dir: tokens are only sent over TLS")
        return None

    def read(name):
        with open(os.path.join(tls_dir, name), "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        root_certificates=read("ca.crt"), private_key=read("client.key"),
        certificate_chain=read("client.crt"))
    if token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token.strip()))
    return creds


def _pump(call, events):
    """Moves a stream's events into a queue, so that the reader can wait
    with a timeout (a silent stream is a dead one); then its end or error."""
    try:
        for event in call:
            events.put(event)
        events.put(_END)
    except grpc.RpcError as err:
        events.put(err)
    except ValueError as err:  # the channel was closed under it
        events.put("channel closed: %s" % err)


def _ids(offer_ids):
    return [offer_ids] if isinstance(offer_ids, str) else list(offer_ids)


def _filters(refuse_seconds):
    if refuse_seconds is None:
        return None
    return pb.Filters(refuse_seconds=refuse_seconds)
