//! The tenant a job or a framework is charged to, and the one place that
//! says what an unset tenant means.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The tenant of jobs submitted without tokens (no security configured),
/// and of jobs and frameworks recorded before tenants existed.
pub const DEFAULT_TENANT: &str = "default";

/// A tenant as a job or framework records it: set by the master from the
/// caller's token, or unset (empty on the wire and in older log entries),
/// which is the default tenant. Serialized as its bare string, as the log
/// always had it.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Tenant(String);

impl Tenant {
    /// `name` as recorded; "" is unset.
    pub fn new(name: impl Into<String>) -> Tenant {
        Tenant(name.into())
    }

    /// The tenant charged: its name, or the default tenant's when unset.
    pub fn name(&self) -> &str {
        if self.0.is_empty() {
            DEFAULT_TENANT
        } else {
            &self.0
        }
    }

    /// Whether none was recorded.
    pub fn is_unset(&self) -> bool {
        self.0.is_empty()
    }

    /// As recorded and sent: "" when unset.
    pub fn as_recorded(&self) -> &str {
        &self.0
    }

    /// The recorded form, for the wire.
    pub fn into_recorded(self) -> String {
        self.0
    }
}

impl From<String> for Tenant {
    fn from(name: String) -> Tenant {
        Tenant(name)
    }
}

impl From<&str> for Tenant {
    fn from(name: &str) -> Tenant {
        Tenant(name.to_string())
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_tenant_is_the_default_and_keeps_its_recorded_form() {
        let unset = Tenant::default();
        assert_eq!((unset.name(), unset.as_recorded()), (DEFAULT_TENANT, ""));
        assert!(unset.is_unset());
        assert_eq!(serde_json::to_string(&unset).unwrap(), "\"\"");
        let a: Tenant = serde_json::from_str("\"team-a\"").unwrap();
        assert_eq!(
            (a.name(), a.to_string(), a.is_unset()),
            ("team-a", "team-a".into(), false)
        );
    }
}
