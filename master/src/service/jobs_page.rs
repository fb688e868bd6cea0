//! ListJobs in pages. PURE: the request is checked and the page chosen
//! from a state, without I/O.
//!
//! Order: newest first, by the job's sequence number (the N of `job-N`,
//! given by apply in log order). The page token is the sequence number of
//! the page's last job: the next page holds the jobs older than it, so jobs
//! submitted while a client pages (all newer) never shift a page: none is
//! skipped or repeated. Each page ends at `limit` jobs or before its
//! encoded size passes the byte budget, whichever comes first.

use gpuctl_core::types::JobsQuery;
use gpuctl_proto::pb;
use prost::encoding::{encoded_len_varint, key_len};

use crate::state::{job_seq, JobRecord, State};

/// Most bytes of an encoded page: gRPC's default message limit, so that
/// any client can read any page, whatever the jobs hold. A single job
/// bigger than that (impossible within the limits on a spec, but a job
/// keeps every task of every retry) is sent alone.
pub const PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Room kept for `next_page_token` (a decimal u64 and its field header).
const TOKEN_BYTES: usize = 32;

fn wanted(req: &JobsQuery, tenant: Option<&str>, j: &JobRecord) -> bool {
    tenant.is_none_or(|t| t == j.spec.tenant.name())
        && (req.states.is_empty() || req.states.contains(&j.state))
        && req.name.as_ref().is_none_or(|n| *n == j.spec.name)
        && req.before.is_none_or(|b| job_seq(&j.id) < b)
}

/// The page of jobs `req` asks for, newest first, each converted by
/// `to_pb`; at most `req.limit` jobs and `budget` encoded bytes (at least
/// one job, if any matches).
pub fn page(
    state: &State,
    req: &JobsQuery,
    tenant: Option<&str>,
    budget: usize,
    mut to_pb: impl FnMut(&JobRecord) -> pb::Job,
) -> pb::ListJobsResponse {
    let mut matching: Vec<(u64, &JobRecord)> = state
        .jobs()
        .values()
        .filter(|j| wanted(req, tenant, j))
        .map(|j| (job_seq(&j.id), j))
        .collect();
    // The newest limit + 1 (one more tells whether a next page exists),
    // without sorting them all.
    let keep = req.limit.saturating_add(1);
    if matching.len() > keep {
        matching.select_nth_unstable_by(keep - 1, |a, b| b.0.cmp(&a.0));
        matching.truncate(keep);
    }
    matching.sort_unstable_by_key(|m| std::cmp::Reverse(m.0));

    let mut jobs = Vec::new();
    let mut size = TOKEN_BYTES;
    let mut last = None;
    for (seq, j) in matching.iter().take(req.limit) {
        let job = to_pb(j);
        let len = prost::Message::encoded_len(&job);
        let len = key_len(1) + encoded_len_varint(len as u64) + len;
        if !jobs.is_empty() && size + len > budget {
            break;
        }
        size += len;
        jobs.push(job);
        last = Some(*seq);
    }
    let more = matching.len() > jobs.len();
    pb::ListJobsResponse {
        jobs,
        next_page_token: match last {
            Some(seq) if more => seq.to_string(),
            _ => String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::Driver;
    use crate::state::{Command, Outcome};
    use gpuctl_core::types::{JobSpec, Resources};
    use prost::Message as _;

    /// The state tests' driver, with jobs and pages.
    struct T(Driver);

    impl std::ops::Deref for T {
        type Target = Driver;
        fn deref(&self) -> &Driver {
            &self.0
        }
    }

    impl std::ops::DerefMut for T {
        fn deref_mut(&mut self) -> &mut Driver {
            &mut self.0
        }
    }

    impl T {
        fn new() -> T {
            T(Driver::new(&[]))
        }
        fn submit(&mut self, name: &str, env_bytes: usize) -> String {
            let mut spec = JobSpec::new(name, vec!["true".into()], Resources::default());
            if env_bytes > 0 {
                spec.template
                    .env
                    .insert("BIG".into(), "x".repeat(env_bytes));
            }
            let at_ms = self.i;
            match self
                .apply(Command::SubmitJob {
                    spec,
                    at_ms,
                    request_id: None,
                })
                .unwrap()
            {
                Outcome::JobSubmitted { job_id } => job_id,
                o => panic!("{o:?}"),
            }
        }
        fn cancel(&mut self, id: &str) {
            let at_ms = self.i;
            self.apply(Command::CancelJob {
                job_id: id.into(),
                at_ms,
            })
            .unwrap();
        }
        /// One page as the service answers it.
        fn page(&self, r: &pb::ListJobsRequest, budget: usize) -> pb::ListJobsResponse {
            let req = JobsQuery::try_from(r.clone()).unwrap();
            page(&self.s, &req, None, budget, |j| pb::Job {
                id: j.id.clone(),
                spec: Some(j.spec.clone().into()),
                state: pb::JobState::from(j.state) as i32,
                ..Default::default()
            })
        }
        /// Every page, in order; the ids of each.
        fn pages(&self, mut r: pb::ListJobsRequest, budget: usize) -> Vec<Vec<String>> {
            let mut out = Vec::new();
            loop {
                let resp = self.page(&r, budget);
                out.push(resp.jobs.iter().map(|j| j.id.clone()).collect());
                if resp.next_page_token.is_empty() {
                    return out;
                }
                r.page_token = resp.next_page_token;
            }
        }
    }

    fn ids(range: impl Iterator<Item = u64>) -> Vec<String> {
        range.map(|n| format!("job-{n}")).collect()
    }

    #[test]
    fn an_empty_request_gets_the_newest_500() {
        let mut t = T::new();
        for _ in 0..1200 {
            t.submit("j", 0);
        }
        let resp = t.page(&pb::ListJobsRequest::default(), PAGE_BYTES);
        assert_eq!(resp.jobs.len(), 500);
        assert_eq!(resp.jobs[0].id, "job-1200");
        assert_eq!(resp.jobs[499].id, "job-701");
        assert_eq!(resp.next_page_token, "701");
        // Over the maximum: read as 1000.
        let r = pb::ListJobsRequest {
            limit: 5000,
            ..Default::default()
        };
        assert_eq!(t.page(&r, PAGE_BYTES).jobs.len(), 1000);
    }

    #[test]
    fn pages_cover_every_job_once_newest_first() {
        let mut t = T::new();
        for _ in 0..25 {
            t.submit("j", 0);
        }
        let r = pb::ListJobsRequest {
            limit: 10,
            ..Default::default()
        };
        let pages = t.pages(r, PAGE_BYTES);
        assert_eq!(
            pages,
            vec![
                ids((16..=25).rev()),
                ids((6..=15).rev()),
                ids((1..=5).rev())
            ]
        );
        // Exactly a multiple of the limit: the last full page has no token.
        let r = pb::ListJobsRequest {
            limit: 5,
            ..Default::default()
        };
        let pages = t.pages(r, PAGE_BYTES);
        assert_eq!(pages.len(), 5);
        assert_eq!(pages[4], ids((1..=5).rev()));
        // No jobs: one empty page.
        assert_eq!(
            T::new().pages(pb::ListJobsRequest::default(), PAGE_BYTES),
            vec![Vec::<String>::new()]
        );
    }

    #[test]
    fn submits_between_pages_neither_skip_nor_repeat() {
        let mut t = T::new();
        for _ in 0..10 {
            t.submit("j", 0);
        }
        let mut r = pb::ListJobsRequest {
            limit: 4,
            ..Default::default()
        };
        let mut seen = Vec::new();
        loop {
            let resp = t.page(&r, PAGE_BYTES);
            seen.extend(resp.jobs.iter().map(|j| j.id.clone()));
            // Others submit while this client pages.
            t.submit("j", 0);
            t.submit("j", 0);
            if resp.next_page_token.is_empty() {
                break;
            }
            r.page_token = resp.next_page_token;
        }
        assert_eq!(seen, ids((1..=10).rev()));
    }

    #[test]
    fn filters_by_state_and_name() {
        let mut t = T::new();
        for i in 1..=12 {
            let id = t.submit(if i % 2 == 0 { "even" } else { "odd" }, 0);
            if i % 3 == 0 {
                t.cancel(&id);
            }
        }
        let cancelled = pb::ListJobsRequest {
            states: vec![pb::JobState::JobCancelled as i32],
            limit: 2,
            ..Default::default()
        };
        assert_eq!(
            t.pages(cancelled.clone(), PAGE_BYTES),
            vec![ids([12, 9].into_iter()), ids([6, 3].into_iter())]
        );
        let even_cancelled = pb::ListJobsRequest {
            name: "even".into(),
            ..cancelled
        };
        assert_eq!(
            t.pages(even_cancelled, PAGE_BYTES),
            vec![ids([12, 6].into_iter())]
        );
        let queued_or_cancelled_odd = pb::ListJobsRequest {
            states: vec![
                pb::JobState::JobQueued as i32,
                pb::JobState::JobCancelled as i32,
            ],
            name: "odd".into(),
            ..Default::default()
        };
        assert_eq!(
            t.pages(queued_or_cancelled_odd, PAGE_BYTES),
            vec![ids([11, 9, 7, 5, 3, 1].into_iter())]
        );
        let nobody = pb::ListJobsRequest {
            name: "nobody".into(),
            ..Default::default()
        };
        assert_eq!(t.pages(nobody, PAGE_BYTES), vec![Vec::<String>::new()]);
    }

    #[test]
    fn a_page_stops_before_the_byte_budget() {
        let mut t = T::new();
        // 12 jobs of 30 KB each (within the limits): 360 KB in all.
        for _ in 0..12 {
            t.submit("big", 30_000);
        }
        let budget = 100_000;
        let pages = t.pages(pb::ListJobsRequest::default(), budget);
        assert_eq!(pages.concat(), ids((1..=12).rev()));
        assert!(pages.len() >= 4, "{pages:?}");
        let mut r = pb::ListJobsRequest::default();
        loop {
            let resp = t.page(&r, budget);
            assert!(resp.encoded_len() <= budget, "{}", resp.encoded_len());
            if resp.next_page_token.is_empty() {
                break;
            }
            r.page_token = resp.next_page_token;
        }
        // The real budget with jobs at the env limit: a page stays under
        // gRPC's default 4 MiB limit.
        let mut t = T::new();
        for _ in 0..40 {
            t.submit("max", gpuctl_core::convert::MAX_ENV_TOTAL_BYTES - 3);
        }
        let resp = t.page(&pb::ListJobsRequest::default(), PAGE_BYTES);
        assert!(resp.encoded_len() <= PAGE_BYTES);
        assert!(resp.jobs.len() < 40 && !resp.next_page_token.is_empty());
        // A job bigger than the budget comes alone.
        let resp = t.page(&pb::ListJobsRequest::default(), 1000);
        assert_eq!(resp.jobs.len(), 1);
        assert_eq!(resp.next_page_token, "40");
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (
                pb::ListJobsRequest {
                    states: vec![pb::JobState::JobRunning as i32, 42],
                    ..Default::default()
                },
                "states[1]",
            ),
            (
                pb::ListJobsRequest {
                    states: vec![0],
                    ..Default::default()
                },
                "states[0]",
            ),
            (
                pb::ListJobsRequest {
                    name: "a b".into(),
                    ..Default::default()
                },
                "name",
            ),
            (
                pb::ListJobsRequest {
                    page_token: "job-7".into(),
                    ..Default::default()
                },
                "page_token",
            ),
        ];
        for (r, field) in cases {
            assert_eq!(JobsQuery::try_from(r).unwrap_err().field, field);
        }
    }
}
