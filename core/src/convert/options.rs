//! A task's options ([`TaskOptions`]) to and from the wire: the copy both
//! ways and the checks of a submitted job's. A new option is a line in
//! each function here.

use super::spec::Checks;
use super::*;
use crate::pb;
use crate::types::*;

/// The options as sent; `None` when every option is unset, so the wire of
/// a job without options is what it was before they existed.
pub fn options_to_pb(o: TaskOptions) -> Option<pb::TaskOptions> {
    if o.is_default() {
        return None;
    }
    let TaskOptions {} = o;
    Some(pb::TaskOptions {})
}

/// The options as received, uncopied fields checked: a submitted job's
/// against every bound (`prefix` names its spec), a task from the master
/// for shape only (its job's were checked on submit).
pub(super) fn options_from_pb(
    _prefix: &str,
    o: Option<pb::TaskOptions>,
    _runtime: Runtime,
    _checks: Checks,
) -> Result<TaskOptions> {
    let Some(pb::TaskOptions {}) = o else {
        return Ok(TaskOptions::default());
    };
    Ok(TaskOptions {})
}

/// The options as a view shows them (`jobs get --json`, the console): as
/// sent, unchecked.
pub fn options_view(o: Option<&pb::TaskOptions>) -> TaskOptions {
    let Some(pb::TaskOptions {}) = o else {
        return TaskOptions::default();
    };
    TaskOptions {}
}
