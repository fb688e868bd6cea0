//! Which output of a job a log stream follows (`gpuctl jobs logs`, the web
//! console), and when it has all been written.

use crate::convert::task_state_from_pb;
use crate::pb;

/// Which output of a job is asked for: one attempt (1-based; `None`: the
/// latest), one rank or all, and whether to follow it as it is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogSelection {
    pub follow: bool,
    pub rank: Option<u32>,
    pub attempt: Option<u32>,
}

impl LogSelection {
    /// Whether the tasks it selects have all ended: those of
    /// `attempt` (1-based; `None`: the latest), of one `rank` or all. Tasks
    /// come oldest first, and an attempt starts all its ranks at once from
    /// rank 0 (the master's rule), so a rank 0 starts the next one. An attempt
    /// not started yet has not ended.
    pub fn ended(&self, tasks: &[pb::Task]) -> bool {
        let mut attempts: Vec<Vec<&pb::Task>> = Vec::new();
        for t in tasks {
            match attempts.last_mut() {
                Some(a) if t.rank != 0 => a.push(t),
                _ => attempts.push(vec![t]),
            }
        }
        let chosen = match self.attempt {
            Some(n) => attempts.get((n as usize).saturating_sub(1)),
            None => attempts.last(),
        };
        chosen.is_some_and(|a| {
            a.iter()
                .filter(|t| self.rank.is_none_or(|r| r == t.rank))
                .all(|t| task_state_from_pb("state", t.state).is_ok_and(|s| s.is_terminal()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_tasks_are_those_of_the_attempt_and_rank_asked() {
        let task = |rank, state: pb::TaskState| pb::Task {
            rank,
            state: state as i32,
            ..Default::default()
        };
        use pb::TaskState::{TaskFailed, TaskKilled, TaskRunning};
        // Attempt 1 ended (ranks 0, 1); attempt 2 runs rank 0, rank 1 ended.
        let tasks = vec![
            task(0, TaskKilled),
            task(1, TaskFailed),
            task(0, TaskRunning),
            task(1, TaskFailed),
        ];
        let sel = |attempt, rank| LogSelection {
            follow: true,
            rank,
            attempt,
        };
        assert!(sel(Some(1), None).ended(&tasks));
        assert!(!sel(None, None).ended(&tasks));
        assert!(!sel(Some(2), Some(0)).ended(&tasks));
        assert!(sel(None, Some(1)).ended(&tasks));
        // An attempt that has not started has not ended.
        assert!(!sel(Some(3), None).ended(&tasks));
        assert!(!sel(None, None).ended(&[]), "not placed yet");
    }
}
