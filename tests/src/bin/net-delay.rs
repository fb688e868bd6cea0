//! `net-delay --queue N --delay-ms MS`: holds every packet that iptables
//! sends to NFQUEUE `N` (of the network namespace it runs in) for `MS`
//! milliseconds, then lets it go on. The kernel here has no `netem`; with
//! an iptables `statistic` drop before it, this makes a lossy, slow link
//! between test hosts (tests/src/netlab.rs). Packets leave in the order
//! they came, as on a real link of constant delay.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::time::{Duration, Instant};

use nfq::{Queue, Verdict};

struct Args {
    queue: u16,
    delay: Duration,
}

fn parse() -> Result<Args, String> {
    let mut queue = None;
    let mut delay = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let v = it.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--queue" => queue = Some(v.parse().map_err(|e| format!("--queue {v}: {e}"))?),
            "--delay-ms" => {
                delay = Some(Duration::from_millis(
                    v.parse().map_err(|e| format!("--delay-ms {v}: {e}"))?,
                ))
            }
            _ => return Err(format!("unknown option {a}")),
        }
    }
    Ok(Args {
        queue: queue.ok_or("--queue is required")?,
        delay: delay.ok_or("--delay-ms is required")?,
    })
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("net-delay: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("net-delay: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> std::io::Result<()> {
    let mut q = Queue::open()?;
    q.bind(args.queue)?;
    // Only the verdict matters, not the payload; room for a few seconds of
    // a busy link's packets.
    q.set_copy_range(args.queue, 64)?;
    q.set_queue_max_len(args.queue, 65_536)?;
    q.set_nonblocking(true);
    let mut held = VecDeque::new();
    eprintln!(
        "net-delay: queue {} holding packets {} ms",
        args.queue,
        args.delay.as_millis()
    );
    loop {
        let mut got = false;
        loop {
            match q.recv() {
                Ok(msg) => {
                    held.push_back((Instant::now() + args.delay, msg));
                    got = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // The kernel dropped packets for a full socket buffer:
                // they are lost, like on a congested link; go on.
                Err(e) if e.raw_os_error() == Some(libc_enobufs()) => break,
                Err(e) => return Err(e),
            }
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            if let Some((_, mut msg)) = held.pop_front() {
                msg.set_verdict(Verdict::Accept);
                q.verdict(msg)?;
            }
        }
        if !got {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// ENOBUFS on Linux.
const fn libc_enobufs() -> i32 {
    105
}
