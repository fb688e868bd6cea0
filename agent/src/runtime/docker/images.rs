//! Images and CDI: pulled when missing (with what they require of the driver), and the daemon's CDI support.

use super::*;

impl DockerRuntime {
    /// Makes sure `image` is present locally, pulling it if not, and reads
    /// what the container's configuration depends on.
    pub(super) async fn ensure_image(&self, image: &str) -> Result<ImageFacts, RuntimeError> {
        match self.client()?.inspect_image(image).await {
            Ok(info) => return Ok(ImageFacts::from(&info)),
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                return Err(RuntimeError::Image {
                    image: image.to_string(),
                    reason: format!("inspect: {e}"),
                })
            }
        }
        let (from_image, tag) = split_reference(image);
        tracing::info!(image, "image not present locally, pulling");
        let mut pull = self.client()?.create_image(
            Some(CreateImageOptions {
                from_image,
                tag,
                ..Default::default()
            }),
            None,
            None,
        );
        while let Some(progress) = pull.next().await {
            progress.map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("not present on this host and the pull failed: {e}"),
            })?;
        }
        let info = self
            .client()?
            .inspect_image(image)
            .await
            .map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("inspect after pull: {e}"),
            })?;
        Ok(ImageFacts::from(&info))
    }

    /// What the daemon says of CDI: its API version and the directories
    /// its CDI registry reads (empty: CDI off, or a Docker before 25).
    pub(super) async fn daemon_cdi(&self) -> Result<DaemonCdi, RuntimeError> {
        let docker = self.client()?;
        let version = docker.version().await.map_err(|e| self.err(e))?;
        let info = docker.info().await.map_err(|e| self.err(e))?;
        Ok(DaemonCdi {
            api_version: version.api_version.unwrap_or_default(),
            // Docker resolves symlinks in its own (/var/run/cdi is /run/cdi).
            spec_dirs: info
                .cdi_spec_dirs
                .unwrap_or_default()
                .iter()
                .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| PathBuf::from(d)))
                .collect(),
        })
    }

    /// The CDI device request for a task's GPUs when the daemon takes one;
    /// `None`: they go with `--device`, as with every Docker before 25.
    pub(super) async fn cdi_request(
        &self,
        devices: &[crate::cdi::CdiDevice],
    ) -> Option<DeviceRequest> {
        if devices.is_empty() {
            return None;
        }
        let decision = match self.daemon_cdi().await {
            Ok(daemon) => cdi_device_request(&daemon, devices),
            Err(e) => Err(format!("the daemon's CDI support is unknown ({e})")),
        };
        let way = match &decision {
            Ok(_) => "CDI device requests (HostConfig.DeviceRequests, driver cdi)".to_string(),
            Err(why) => format!("--device, not CDI: {why}"),
        };
        let mut last = self.gpu_path.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() != Some(way.as_str()) {
            tracing::info!("GPU containers get their GPUs through {way}");
            *last = Some(way);
        }
        drop(last);
        if let Ok(r) = &decision {
            tracing::debug!(devices = ?r.device_ids, "CDI device request");
        }
        decision.ok()
    }
}

/// Splits `repo[:tag]` for a pull. Without a tag Docker would pull every tag,
/// so it is `latest`; a digest reference is passed whole.
pub(super) fn split_reference(image: &str) -> (&str, &str) {
    if image.contains('@') {
        return (image, "");
    }
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    match image[name_start..].rfind(':') {
        Some(i) => (&image[..name_start + i], &image[name_start + i + 1..]),
        None => (image, "latest"),
    }
}
