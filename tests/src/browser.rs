//! A real headless Chromium driven over the Chrome DevTools Protocol, for
//! the web console's tests: navigate, evaluate JavaScript in the page,
//! click and type with input events, take screenshots.
//!
//! [`Browser::start_or_skip`] finds `chromium` (Debian's package; or
//! `GPUCTL_CHROMIUM`): without it the test prints why and returns, and with
//! `GPUCTL_REQUIRE_DOCKER=1` (CI, which installs it) it fails instead.
//! JavaScript dialogs (`confirm`) are accepted as they open. Screenshots go
//! to `$GPUCTL_ARTIFACTS` or `<target>/console-artifacts`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A connection to one page's DevTools endpoint.
struct Cdp {
    out: mpsc::UnboundedSender<String>,
    pending: Pending,
    next_id: Arc<AtomicU64>,
    /// Exceptions and console errors of the page, for failure messages.
    errors: Arc<Mutex<Vec<String>>>,
}

impl Cdp {
    async fn connect(ws_url: &str) -> Cdp {
        let (ws, _) = tokio_tungstenite::connect_async(ws_url)
            .await
            .unwrap_or_else(|e| panic!("connect to DevTools at {ws_url}: {e}"));
        let (mut sink, mut stream) = ws.split();
        let (out, mut out_rx) = mpsc::unbounded_channel::<String>();
        tokio::spawn(async move {
            while let Some(text) = out_rx.recv().await {
                if sink.send(Message::Text(text)).await.is_err() {
                    return;
                }
            }
        });
        let pending: Pending = Arc::default();
        let next_id = Arc::new(AtomicU64::new(1));
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let (p, ids, errs, replies) = (
            pending.clone(),
            next_id.clone(),
            errors.clone(),
            out.clone(),
        );
        tokio::spawn(async move {
            while let Some(Ok(msg)) = stream.next().await {
                let Message::Text(text) = msg else { continue };
                let Ok(v) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                if let Some(id) = v["id"].as_u64() {
                    if let Some(tx) = p.lock().unwrap().remove(&id) {
                        let _ = tx.send(v);
                    }
                    continue;
                }
                match v["method"].as_str() {
                    // A dialog blocks the page (and our calls) until answered.
                    Some("Page.javascriptDialogOpening") => {
                        let id = ids.fetch_add(1, Ordering::SeqCst);
                        let cmd = json!({"id": id, "method": "Page.handleJavaScriptDialog",
                                         "params": {"accept": true}});
                        let _ = replies.send(cmd.to_string());
                    }
                    Some("Runtime.exceptionThrown") => errs
                        .lock()
                        .unwrap()
                        .push(format!("exception: {}", v["params"]["exceptionDetails"])),
                    Some("Runtime.consoleAPICalled") if v["params"]["type"] == "error" => errs
                        .lock()
                        .unwrap()
                        .push(format!("console.error: {}", v["params"]["args"])),
                    _ => {}
                }
            }
        });
        Cdp {
            out,
            pending,
            next_id,
            errors,
        }
    }

    async fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let cmd = json!({"id": id, "method": method, "params": params});
        self.out
            .send(cmd.to_string())
            .map_err(|_| "DevTools connection closed".to_string())?;
        let reply = tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .map_err(|_| format!("{method}: no answer within 30 s"))?
            .map_err(|_| "DevTools connection closed".to_string())?;
        if let Some(e) = reply.get("error") {
            return Err(format!("{method}: {e}"));
        }
        Ok(reply["result"].clone())
    }
}

/// A headless Chromium with one page, killed when dropped.
pub struct Browser {
    rt: tokio::runtime::Runtime,
    child: Child,
    _profile: tempfile::TempDir,
    cdp: Cdp,
    pub artifacts: PathBuf,
}

/// Where screenshots are kept.
pub fn artifacts_dir() -> PathBuf {
    std::env::var_os("GPUCTL_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::target_dir().join("console-artifacts"))
}

fn find_chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GPUCTL_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// Browser window size: the screenshots' size.
pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 1000;

impl Browser {
    /// Starts Chromium, or says why not and returns `None` (panics with
    /// `GPUCTL_REQUIRE_DOCKER=1`). `flags`: more command line flags.
    pub fn start_or_skip(test: &str, flags: &[&str]) -> Option<Browser> {
        let Some(exe) = find_chromium() else {
            let why = "chromium not found (apt-get install chromium, or set GPUCTL_CHROMIUM)";
            if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
                panic!("{test}: {why}, and GPUCTL_REQUIRE_DOCKER=1 requires it");
            }
            eprintln!("skipped {test}: {why}");
            return None;
        };
        let profile = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(profile.path().join("chromium.log")).unwrap();
        let child = Command::new(&exe)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--hide-scrollbars",
                "--mute-audio",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                &format!("--window-size={WIDTH},{HEIGHT}"),
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(flags)
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", exe.display()));
        // Chromium writes its port there once it listens.
        let port_file = profile.path().join("DevToolsActivePort");
        crate::wait_for(Duration::from_secs(30), "chromium's DevTools port", || {
            std::fs::read_to_string(&port_file).is_ok_and(|s| s.lines().count() >= 2)
        });
        let text = std::fs::read_to_string(&port_file).unwrap();
        let port: u16 = text.lines().next().unwrap().trim().parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ws_url = page_ws_url(port);
        let cdp = rt.block_on(Cdp::connect(&ws_url));
        let b = Browser {
            rt,
            child,
            _profile: profile,
            cdp,
            artifacts: artifacts_dir(),
        };
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": false}),
        );
        Some(b)
    }

    /// A DevTools command; panics on an error.
    pub fn call(&self, method: &str, params: Value) -> Value {
        self.rt
            .block_on(self.cdp.call(method, params))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn goto(&self, url: &str) {
        let r = self.call("Page.navigate", json!({ "url": url }));
        assert!(r.get("errorText").is_none(), "navigate to {url}: {r}");
    }

    /// Evaluates `js` in the page (a promise is awaited) and returns its
    /// value; panics when it throws.
    pub fn eval(&self, js: &str) -> Value {
        self.try_eval(js).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_eval(&self, js: &str) -> Result<Value, String> {
        let r = self.rt.block_on(self.cdp.call(
            "Runtime.evaluate",
            json!({"expression": js, "awaitPromise": true, "returnByValue": true}),
        ))?;
        if let Some(e) = r.get("exceptionDetails") {
            return Err(format!("{js}: {e}"));
        }
        Ok(r["result"]["value"].clone())
    }

    /// Evaluates `js` until it gives something truthy (not null, false, 0
    /// or ""), and returns that; panics after `timeout` with the page's
    /// text and errors.
    pub fn wait_for(&self, what: &str, js: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        let mut last = Value::Null;
        while Instant::now() < deadline {
            match self.try_eval(js) {
                Ok(v) if truthy(&v) => return v,
                Ok(v) => last = v,
                // The page may be navigating: try again.
                Err(e) => last = Value::String(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "waited {}s for {what}; last: {last}\n--- page text ---\n{}\n--- page errors ---\n{}",
            timeout.as_secs(),
            self.try_eval("document.body.innerText").unwrap_or_default(),
            self.errors().join("\n")
        );
    }

    /// The page's exceptions and console errors so far.
    pub fn errors(&self) -> Vec<String> {
        self.cdp.errors.lock().unwrap().clone()
    }

    /// The centre of the element `selector`, scrolled into view.
    fn centre(&self, selector: &str) -> (f64, f64) {
        let sel = serde_json::to_string(selector).unwrap();
        let v = self.eval(&format!(
            "(() => {{ const e = document.querySelector({sel}); if (!e) return null; \
             e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); \
             return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        ));
        let xy = v
            .as_array()
            .unwrap_or_else(|| panic!("no element {selector} to click"));
        (xy[0].as_f64().unwrap(), xy[1].as_f64().unwrap())
    }

    /// A mouse click on the element, as a person's: pressed and released
    /// at its centre.
    pub fn click(&self, selector: &str) {
        let (x, y) = self.centre(selector);
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}),
            );
        }
    }

    /// Clicks into the field, clears it and types `text`.
    pub fn type_into(&self, selector: &str, text: &str) {
        self.click(selector);
        let sel = serde_json::to_string(selector).unwrap();
        self.eval(&format!(
            "(() => {{ const e = document.querySelector({sel}); e.focus(); e.value = ''; }})()"
        ));
        self.call("Input.insertText", json!({ "text": text }));
    }

    /// The text of the first element matching `selector` ("" if none).
    pub fn text(&self, selector: &str) -> String {
        let sel = serde_json::to_string(selector).unwrap();
        self.eval(&format!(
            "(document.querySelector({sel}) || {{innerText: ''}}).innerText"
        ))
        .as_str()
        .unwrap_or_default()
        .to_string()
    }

    /// Saves a PNG of the page to the artifacts directory as `name.png`.
    pub fn screenshot(&self, name: &str) -> PathBuf {
        use base64::Engine as _;
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(&self.artifacts).unwrap();
        let path = self.artifacts.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot: {}", path.display());
        path
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        _ => true,
    }
}

/// `GET path` of Chromium's DevTools HTTP server; the body. (It keeps the
/// connection open whatever the request says: read by Content-Length.)
fn devtools_get(port: u16, path: &str) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    String::from_utf8_lossy(&body).into_owned()
}

/// The DevTools WebSocket URL of the browser's first page.
fn page_ws_url(port: u16) -> String {
    let mut last = String::new();
    for _ in 0..100 {
        let body = devtools_get(port, "/json/list");
        if let Ok(Value::Array(targets)) = serde_json::from_str::<Value>(&body) {
            if let Some(url) = targets
                .iter()
                .find(|t| t["type"] == "page")
                .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            {
                return url.to_string();
            }
        }
        last = body;
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("chromium lists no page: {last}");
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Copies a screenshot into the docs (`docs/img/NAME.png`) when
/// `GPUCTL_UPDATE_DOCS_IMAGES=1`, so the pictures in docs/console.md are
/// the tests' own.
pub fn update_doc_image(shot: &Path, name: &str) {
    if std::env::var("GPUCTL_UPDATE_DOCS_IMAGES").as_deref() != Ok("1") {
        return;
    }
    let dir = crate::workspace_root().join("docs/img");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(shot, dir.join(format!("{name}.png"))).unwrap();
}
