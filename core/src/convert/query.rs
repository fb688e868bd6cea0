//! The operator's queries: ListJobs pages, drain deadlines.

use super::*;
use crate::pb;
use crate::types::*;

/// Jobs in a ListJobs page when the request says 0.
pub const DEFAULT_PAGE_LIMIT: u32 = 500;
/// Most jobs in a ListJobs page; a larger limit is read as this.
pub const MAX_PAGE_LIMIT: u32 = 1000;

impl TryFrom<pb::ListJobsRequest> for JobsQuery {
    type Error = ConvertError;
    fn try_from(r: pb::ListJobsRequest) -> Result<Self> {
        let states = r
            .states
            .iter()
            .enumerate()
            .map(|(i, v)| job_state_from_pb(&format!("states[{i}]"), *v))
            .collect::<Result<std::collections::HashSet<_>>>()?;
        let name = if r.name.is_empty() {
            None
        } else {
            check_id("name", &r.name)?;
            Some(r.name)
        };
        let limit = match r.limit {
            0 => DEFAULT_PAGE_LIMIT,
            n => n.min(MAX_PAGE_LIMIT),
        } as usize;
        let before = if r.page_token.is_empty() {
            None
        } else {
            Some(r.page_token.parse::<u64>().map_err(|_| {
                ConvertError::new(
                    "page_token",
                    "not a token from a ListJobs response (send it as it came)",
                )
            })?)
        };
        Ok(JobsQuery {
            states,
            name,
            limit,
            before,
        })
    }
}

/// Longest drain deadline accepted: a year.
pub const MAX_DRAIN_DEADLINE_SECS: f64 = 365.0 * 86400.0;

/// A drain's `deadline_secs`, checked, as the deadline counted from `at_ms`.
pub fn drain_deadline(at_ms: u64, secs: Option<f64>) -> Result<Option<u64>> {
    match secs {
        None => Ok(None),
        Some(s) if s.is_finite() && (0.0..=MAX_DRAIN_DEADLINE_SECS).contains(&s) => {
            Ok(Some(at_ms.saturating_add((s * 1000.0) as u64)))
        }
        Some(s) => Err(ConvertError::new(
            "deadline_secs",
            format!("{s} is not a number of seconds between 0 and {MAX_DRAIN_DEADLINE_SECS}"),
        )),
    }
}
