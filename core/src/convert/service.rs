//! A service as it enters the cluster: its name, replica count and the
//! template each replica's job is made from.

use crate::pb;

use super::{ConvertError, Result, MAX_SERVICE_REPLICAS};
use crate::types::{check_service_name, JobSpec, RestartPolicy, ServiceSpec, MAX_DRAIN_MS};

impl TryFrom<pb::CreateServiceRequest> for ServiceSpec {
    type Error = ConvertError;
    fn try_from(r: pb::CreateServiceRequest) -> Result<ServiceSpec> {
        check_service_name(&r.name).map_err(|e| ConvertError::new("name", e))?;
        if r.replicas > MAX_SERVICE_REPLICAS {
            return Err(ConvertError::new(
                "replicas",
                format!("is {}: at most {MAX_SERVICE_REPLICAS}", r.replicas),
            ));
        }
        let Some(t) = r.template else {
            return Err(ConvertError::new("template", "is missing"));
        };
        // A replica is one task, restarted whenever it ends: what a job
        // says of gangs and retries has no meaning here.
        let refused: [(&str, bool); 6] = [
            ("template.replicas", t.replicas > 1),
            ("template.min_replicas", t.min_replicas > 0),
            ("template.max_retries", t.max_retries > 0),
            ("template.restart_policy", !t.restart_policy.is_empty()),
            ("template.no_requeue", t.no_requeue),
            ("template.service", !t.service.is_empty()),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
            return Err(ConvertError::new(
                *field,
                "must be left unset: a service's replica is one task, started again whenever it \
                 ends (scale with replicas)",
            ));
        }
        if !t.name.is_empty() && t.name != r.name {
            return Err(ConvertError::new(
                "template.name",
                format!(
                    "is {:?}: a replica is named as its service, {:?}",
                    t.name, r.name
                ),
            ));
        }
        let t = pb::JobSpec {
            name: r.name.clone(),
            ..t
        };
        let mut template = JobSpec::try_from(t).map_err(|e| ConvertError {
            field: e.field.replacen("spec.", "template.", 1),
            reason: e.reason,
        })?;
        template.replicas = 1;
        template.restart_policy = RestartPolicy::Always;
        if let Some(ms) = r.drain_ms.filter(|ms| *ms > MAX_DRAIN_MS) {
            return Err(ConvertError::new(
                "drain_ms",
                format!("is {ms}: at most {MAX_DRAIN_MS} (10 minutes)"),
            ));
        }
        Ok(ServiceSpec {
            name: r.name,
            replicas: r.replicas,
            template,
            drain_ms: r.drain_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::CreateServiceRequest {
        pb::CreateServiceRequest {
            name: "llm".into(),
            replicas: 3,
            template: Some(pb::JobSpec {
                command: vec!["serve".into()],
                resources: Some(pb::Resources {
                    gpus: 1,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            drain_ms: None,
        }
    }

    #[test]
    fn a_drain_is_bounded_and_defaults_by_ports() {
        let s = ServiceSpec::try_from(request()).unwrap();
        assert_eq!(s.drain(), 0, "nothing routes to a service without a port");
        let mut r = request();
        if let Some(t) = r.template.as_mut() {
            t.options = Some(pb::TaskOptions {
                port_names: vec!["http".into()],
                ..Default::default()
            });
        }
        assert_eq!(ServiceSpec::try_from(r.clone()).unwrap().drain(), 5_000);
        r.drain_ms = Some(0);
        assert_eq!(ServiceSpec::try_from(r.clone()).unwrap().drain(), 0);
        r.drain_ms = Some(MAX_DRAIN_MS + 1);
        let e = ServiceSpec::try_from(r).unwrap_err();
        assert_eq!(e.field, "drain_ms", "{e}");
    }

    #[test]
    fn a_service_makes_one_task_replicas_that_always_restart() {
        let s = ServiceSpec::try_from(request()).unwrap();
        assert_eq!(s.name, "llm");
        assert_eq!(s.replicas, 3);
        assert_eq!(s.template.name, "llm");
        assert_eq!(s.template.replicas, 1);
        assert_eq!(s.template.restart_policy, RestartPolicy::Always);
        assert_eq!(s.template.template.resources.gpus, 1);
        assert_eq!(s.template.service, None);
    }

    type Spoil = Box<dyn Fn(&mut pb::CreateServiceRequest)>;

    #[test]
    fn bad_services_are_refused_naming_the_field() {
        let cases: Vec<(Spoil, &str)> = vec![
            (Box::new(|r| r.name = "Bad_Name".into()), "name"),
            (
                Box::new(|r| r.replicas = MAX_SERVICE_REPLICAS + 1),
                "replicas",
            ),
            (Box::new(|r| r.template = None), "template"),
            (
                Box::new(|r| r.template.as_mut().unwrap().replicas = 2),
                "template.replicas",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().max_retries = 3),
                "template.max_retries",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().restart_policy = "never".into()),
                "template.restart_policy",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().no_requeue = true),
                "template.no_requeue",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().service = "svc-1".into()),
                "template.service",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().name = "other".into()),
                "template.name",
            ),
            (
                Box::new(|r| r.template.as_mut().unwrap().command.clear()),
                "template.command",
            ),
        ];
        for (bad, field) in cases {
            let mut r = request();
            bad(&mut r);
            let e = ServiceSpec::try_from(r).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
    }
}
