//! A job's events: a bounded history of what happened to it, like the
//! events `kubectl describe` shows. They are part of the replicated state:
//! apply records them from the command, with the command's time, so every
//! master (and a new leader, or a master restored from a snapshot) has the
//! same history.
//!
//! Bounded: at most [`MAX_EVENTS`] per job, the oldest dropped first (and
//! counted); messages cut at [`MAX_MESSAGE`] bytes. An event identical
//! (kind and message) to one kept already is not added again: that one's
//! count goes up, its last time moves and it moves to the end, so the list
//! is in order of last time, as kubectl shows aggregated events. A job
//! preempted again and again thus keeps a short history.
//!
//! Why a queued job waits changes with every queue pass of the leader and
//! is not replicated (`scheduler/board.rs`), so it is not an event: the
//! events say why the job entered the queue (submitted, requeued after a
//! preemption, a GPU failure, a drain, a retry) and, when the scheduler
//! preempts for it, which jobs; `jobs get` shows the current wait reason.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Most events kept per job.
pub const MAX_EVENTS: usize = 50;
/// Longest message kept, in bytes.
pub const MAX_MESSAGE: usize = 512;

/// What happened. The names are the API's and the CLI's words
/// (`EventKind::as_str`). Snapshots hold them by name: a master that does
/// not know a kind cannot read a snapshot holding it, so a new kind, like
/// any new shape of the state, needs every master upgraded first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// Submitted: waiting for placement.
    Queued,
    /// Tasks placed on agents with exact GPUs.
    Scheduled,
    /// Every task of the attempt runs.
    Started,
    /// The scheduler stops lower-priority jobs for this one.
    Preempting,
    /// Its attempt is stopped for a job of higher priority.
    Preempted,
    /// The scheduler stops other tenants' jobs, over their fair share, for
    /// this one (its tenant is below its share).
    Reclaiming,
    /// Its attempt is stopped to give GPUs back to a tenant below its fair
    /// share.
    Reclaimed,
    /// A task's GPU failed its agent's health checks.
    GpuFailed,
    /// An agent refused to start a task: its driver does not meet the image.
    DriverRefused,
    /// A task was stopped as hung: no output and no GPU activity for its
    /// job's hang timeout (the retry policy applies).
    Hung,
    /// An agent of its tasks stopped heartbeating (tasks keep their GPUs).
    AgentUnreachable,
    /// That agent registered again, still running its tasks.
    AgentReturned,
    /// The agent stayed silent past the lost timeout: its tasks are LOST.
    AgentLost,
    /// An agent of its tasks is drained: its attempt is stopped.
    Drained,
    /// An elastic gang is restarted to grow: GPUs freed for more ranks.
    Growing,
    /// Its GPUs stayed under the idle threshold for the idle window.
    Idle,
    /// Its GPUs are busy again after it was idle.
    Busy,
    /// Back in the queue without using a retry.
    Requeued,
    /// An attempt failed and is started again (a retry used).
    Retrying,
    /// Cancel asked while tasks run: they are being stopped.
    Cancelling,
    Succeeded,
    Failed,
    Cancelled,
    /// A service was created (its own events).
    Created,
    /// A service's replica count changed (its own events).
    Scaled,
    /// Its task's readiness check passes: it serves.
    Ready,
    /// Its task's health check failed (not ready, or stopped for its
    /// liveness check).
    Unhealthy,
    /// A replica left its service: out of the endpoints, it runs until its
    /// drain ends, then is stopped.
    Draining,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Queued => "Queued",
            EventKind::Scheduled => "Scheduled",
            EventKind::Started => "Started",
            EventKind::Preempting => "Preempting",
            EventKind::Preempted => "Preempted",
            EventKind::Reclaiming => "Reclaiming",
            EventKind::Reclaimed => "Reclaimed",
            EventKind::GpuFailed => "GpuFailed",
            EventKind::DriverRefused => "DriverRefused",
            EventKind::Hung => "Hung",
            EventKind::AgentUnreachable => "AgentUnreachable",
            EventKind::AgentReturned => "AgentReturned",
            EventKind::AgentLost => "AgentLost",
            EventKind::Drained => "Drained",
            EventKind::Growing => "Growing",
            EventKind::Idle => "Idle",
            EventKind::Busy => "Busy",
            EventKind::Requeued => "Requeued",
            EventKind::Retrying => "Retrying",
            EventKind::Cancelling => "Cancelling",
            EventKind::Succeeded => "Succeeded",
            EventKind::Failed => "Failed",
            EventKind::Cancelled => "Cancelled",
            EventKind::Created => "Created",
            EventKind::Scaled => "Scaled",
            EventKind::Ready => "Ready",
            EventKind::Unhealthy => "Unhealthy",
            EventKind::Draining => "Draining",
        }
    }

    /// Whether it tells of trouble (kubectl's Warning type) rather than
    /// the normal course of a job.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            EventKind::Preempted
                | EventKind::Reclaimed
                | EventKind::GpuFailed
                | EventKind::DriverRefused
                | EventKind::Hung
                | EventKind::Unhealthy
                | EventKind::Idle
                | EventKind::AgentUnreachable
                | EventKind::AgentLost
                | EventKind::Drained
                | EventKind::Retrying
                | EventKind::Failed
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEvent {
    pub kind: EventKind,
    pub message: String,
    /// When it happened first and last (the commands' times).
    pub first_ms: u64,
    pub last_ms: u64,
    /// How many times it happened (at least 1).
    pub count: u32,
}

/// A job's events, oldest first, at most [`MAX_EVENTS`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Events {
    list: VecDeque<JobEvent>,
    /// Older events dropped to keep the bound.
    dropped: u64,
}

impl Events {
    pub fn record(&mut self, kind: EventKind, message: impl Into<String>, at_ms: u64) {
        let message = cut(message.into());
        if let Some(i) = self
            .list
            .iter()
            .position(|e| e.kind == kind && e.message == message)
        {
            if let Some(mut e) = self.list.remove(i) {
                e.count = e.count.saturating_add(1);
                e.last_ms = e.last_ms.max(at_ms);
                self.list.push_back(e);
            }
            return;
        }
        while self.list.len() >= MAX_EVENTS {
            self.list.pop_front();
            self.dropped = self.dropped.saturating_add(1);
        }
        self.list.push_back(JobEvent {
            kind,
            message,
            first_ms: at_ms,
            last_ms: at_ms,
            count: 1,
        });
    }

    pub fn iter(&self) -> impl Iterator<Item = &JobEvent> {
        self.list.iter()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// The message cut at [`MAX_MESSAGE`] bytes, on a character boundary.
fn cut(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

/// The Queued event of a new job: what it asks.
pub(super) fn queued_words(spec: &gpuctl_core::types::JobSpec) -> String {
    let r = spec.template.resources;
    let n = spec.replicas();
    let gang = if n > 1 {
        format!("{n} replicas of ")
    } else {
        String::new()
    };
    let plural = if r.gpus == 1 { "" } else { "s" };
    let what = match (&spec.placement.mig, spec.placement.fraction) {
        (_, Some(f)) => format!("a fraction of a shared GPU ({} MiB)", f.mem_mib),
        (Some(p), None) => format!("{} MIG device{plural} {p}", r.gpus),
        (None, None) => format!("{} GPU{plural}", r.gpus),
    };
    format!(
        "submitted: {gang}{what}, priority {}; waiting for placement",
        spec.priority
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_oldest_dropped_and_counted() {
        let mut e = Events::default();
        for i in 0..(MAX_EVENTS as u64 + 7) {
            e.record(EventKind::Scheduled, format!("placed {i}"), i);
        }
        assert_eq!(e.len(), MAX_EVENTS);
        assert_eq!(e.dropped(), 7);
        assert_eq!(e.iter().next().unwrap().message, "placed 7");
    }

    #[test]
    fn a_repeat_is_counted_and_moves_to_the_end() {
        let mut e = Events::default();
        e.record(EventKind::Preempted, "preempted by job-3", 10);
        e.record(EventKind::Requeued, "back in the queue", 11);
        e.record(EventKind::Preempted, "preempted by job-3", 20);
        e.record(EventKind::Preempted, "preempted by job-4", 21);
        let v: Vec<_> = e.iter().cloned().collect();
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].kind, EventKind::Requeued);
        assert_eq!(
            (v[1].count, v[1].first_ms, v[1].last_ms),
            (2, 10, 20),
            "{v:?}"
        );
        assert_eq!(v[2].message, "preempted by job-4");
        // The same words under another kind are another event.
        e.record(EventKind::Failed, "preempted by job-4", 22);
        assert_eq!(e.len(), 4);
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let mut e = Events::default();
        e.record(EventKind::Failed, "é".repeat(MAX_MESSAGE), 1);
        let m = &e.iter().next().unwrap().message;
        assert!(m.len() <= MAX_MESSAGE && m.ends_with("..."), "{}", m.len());
    }
}
