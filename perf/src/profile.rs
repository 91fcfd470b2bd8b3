//! Where a path's time goes: `perf record` of the path core (the software `cpu-clock`
//! event; this VM has no PMU) during one extra window of a path, then the samples by
//! thread, object and symbol (`perf report --sort comm,dso,sym`) folded into the parts an
//! operator can act on — the forwarder in userspace, the forwarder's system calls
//! (copy-mode AF_XDP TX: an skb per frame, the veth transmit and, synchronously, the
//! backend's receive up to its socket), the XDP steering program, the helpers it calls
//! (map look-ups, the clock: kernel symbols of the NAPI kthreads), the NAPI kthreads (the veths'
//! receive: the AF_XDP RX copy, frame returns, the kernel paths' whole forwarding), idle
//! — with each part's nanoseconds per delivered packet, and the hottest symbols.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One path's profile.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Profile {
    /// The path (scenario name).
    pub scenario: String,
    /// Samples of the path core.
    pub samples: u64,
    /// Delivered packets/s and the path core's ns per packet in the profiled window.
    pub delivered_pps: f64,
    /// ns of path core per delivered packet in that window.
    pub ns_per_packet: f64,
    /// Share of the samples per part ([`part_of`]), largest first.
    pub parts: Vec<(String, f64)>,
    /// The hottest symbols (share of all samples), at most [`TOP_SYMBOLS`].
    pub top_symbols: Vec<(String, f64)>,
}

/// Symbols listed per profile.
pub const TOP_SYMBOLS: usize = 12;

/// Whether `perf` can be run (`perf --version`).
pub fn available() -> bool {
    Command::new("perf")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A `perf record` of one CPU whose events count only between [`Recorder::enable`] and
/// [`Recorder::disable`] (perf's control FIFOs, `-D -1`: it starts with its events off).
/// perf's own start-up (about a second here) and the generator's happen outside the
/// window: a recording timed by a sleep of its own started up to seconds before the
/// traffic and caught the core mostly idle (99 % in the runs of 2026-12-07).
pub struct Recorder {
    child: std::process::Child,
    ctl: std::fs::File,
    /// Read end, non-blocking: what perf wrote that no command consumed yet.
    ack: std::fs::File,
    pending: String,
    _fifos: tempfile::TempDir,
}

/// Longest wait for perf to answer a control command (its start-up included).
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

impl Recorder {
    /// Starts recording `cpu` into `data`, events off; returns once perf answers.
    pub fn start(cpu: u32, data: &Path) -> Result<Recorder> {
        let fifos = tempfile::tempdir().context("a directory for perf's control FIFOs")?;
        let (ctl_path, ack_path) = (fifos.path().join("ctl"), fifos.path().join("ack"));
        for f in [&ctl_path, &ack_path] {
            let st = Command::new("mkfifo")
                .arg(f)
                .status()
                .context("running mkfifo")?;
            if !st.success() {
                bail!("mkfifo {} failed", f.display());
            }
        }
        // Neither open blocks, whoever comes first: the control FIFO read-write, the ack
        // FIFO read-only and non-blocking (its reads return nothing until perf writes).
        let ctl = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&ctl_path)
            .with_context(|| format!("opening {}", ctl_path.display()))?;
        let ack = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&ack_path)
                .with_context(|| format!("opening {}", ack_path.display()))?
        };
        let control = format!("fifo:{},{}", ctl_path.display(), ack_path.display());
        let child = Command::new("perf")
            .args(["record", "-q", "-D", "-1", "--control", &control])
            .args(["-C", &cpu.to_string(), "-o"])
            .arg(data)
            // Stopped by SIGINT in `finish`; the sleep only bounds a forgotten recorder.
            .args(["--", "sleep", "3600"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting perf record")?;
        let mut r = Recorder {
            child,
            ctl,
            ack,
            pending: String::new(),
            _fifos: fifos,
        };
        // Events are off already: this only waits until perf listens.
        r.command("disable")?;
        Ok(r)
    }

    /// Events on, from now.
    pub fn enable(&mut self) -> Result<()> {
        self.command("enable")
    }

    /// Events off, from now.
    pub fn disable(&mut self) -> Result<()> {
        self.command("disable")
    }

    /// Sends `cmd` and waits for perf's "ack" (bounded; polled every few ms).
    fn command(&mut self, cmd: &str) -> Result<()> {
        use std::io::{Read, Write};
        writeln!(self.ctl, "{cmd}").with_context(|| format!("telling perf to {cmd}"))?;
        let deadline = std::time::Instant::now() + ACK_TIMEOUT;
        let mut buf = [0u8; 64];
        loop {
            if let Some(i) = self.pending.find("ack\n") {
                self.pending.drain(..i + 4);
                return Ok(());
            }
            match self.ack.read(&mut buf) {
                Ok(n) if n > 0 => {
                    self.pending.push_str(&String::from_utf8_lossy(&buf[..n]));
                    continue;
                }
                // 0: perf has not opened its end yet; WouldBlock: nothing written yet.
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e).context("reading perf's acknowledgements"),
            }
            if let Some(st) = self.child.try_wait()? {
                bail!("perf record exited ({st}) before acknowledging {cmd:?}");
            }
            if std::time::Instant::now() >= deadline {
                bail!("perf record did not acknowledge {cmd:?} within {ACK_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops perf (SIGINT: it writes its data and exits) and waits for it.
    pub fn finish(mut self) -> Result<()> {
        let out = self.interrupt_and_wait()?;
        // perf exits 0, or 130 / -SIGINT when the signal reached it while it waited.
        if !out.status.success() && out.status.code().is_some_and(|c| c != 130) {
            bail!(
                "perf record failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    fn interrupt_and_wait(&mut self) -> Result<std::process::Output> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        let status = self.child.wait().context("waiting for perf record")?;
        Ok(std::process::Output {
            status,
            stdout: Vec::new(),
            stderr: stderr.into_bytes(),
        })
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.interrupt_and_wait();
        }
    }
}

/// `perf report` of `data` sorted by `keys`: (share %, samples, the key columns) per line.
fn report(data: &Path, keys: &str) -> Result<Vec<ReportLine>> {
    let out = Command::new("perf")
        .args(["report", "-i"])
        .arg(data)
        .args([
            "--no-children",
            "-n",
            "--sort",
            keys,
            "--stdio",
            "-g",
            "none",
        ])
        .output()
        .context("running perf report")?;
    if !out.status.success() {
        bail!(
            "perf report failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parse_report(&String::from_utf8_lossy(&out.stdout)))
}

/// One line of `perf report`: share %, samples, the sort keys' columns.
pub type ReportLine = (f64, u64, Vec<String>);

/// The lines of `perf report -n --stdio -g none`:
/// "  52.17%  12345  worker-0  [kernel.kallsyms]".
pub fn parse_report(text: &str) -> Vec<ReportLine> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let pct = it.next()?.strip_suffix('%')?.parse::<f64>().ok()?;
            let n = it.next()?.parse::<u64>().ok()?;
            Some((pct, n, it.map(str::to_string).collect()))
        })
        .collect()
}

/// The part of the path a (thread, object, symbol) triple's samples belong to. The
/// helpers an XDP program calls (its map look-ups, the clock) run as kernel symbols of the
/// thread that runs the program: they are the program's part, not the veths' receive.
pub fn part_of(comm: &str, dso: &str, sym: &str) -> &'static str {
    let kernel_thread = comm.starts_with("napi/") || comm.starts_with("ksoftirqd");
    if comm == "swapper" {
        "idle"
    } else if dso.starts_with("bpf_prog_") && dso.ends_with("_steer") && kernel_thread {
        "XDP steering program (in the NAPI kthreads)"
    } else if kernel_thread && dso == "[kernel.kallsyms]" && is_bpf_helper(sym) {
        "XDP programs' helpers: map look-ups, clock (in the NAPI kthreads)"
    } else if kernel_thread {
        "NAPI kthreads: the veths' receive (AF_XDP RX copy, frame returns; a kernel path's whole forwarding)"
    } else if dso == "[kernel.kallsyms]" || dso.starts_with("bpf_prog_") {
        "forwarder's system calls: copy-mode AF_XDP TX (an skb per frame, veth transmit, the backend's receive up to its socket), poll"
    } else {
        "forwarder in userspace (loop, engine, libc)"
    }
}

/// Kernel symbols that run only on behalf of a BPF program: hash, LPM and array map
/// look-ups and the helpers (`bpf_*`, the coarse clock behind `bpf_ktime_get_coarse_ns`).
fn is_bpf_helper(sym: &str) -> bool {
    const PREFIXES: [&str; 8] = [
        "htab_",
        "__htab_",
        "lookup_nulls_elem_raw",
        "lookup_elem_raw",
        "trie_lookup_elem",
        "array_map_",
        "bpf_",
        "ktime_get_coarse",
    ];
    PREFIXES.iter().any(|p| sym.starts_with(p))
}

/// Profiles the data of `data` for `scenario` (its window delivered `delivered_pps` at
/// `ns_per_packet`): one `perf report` by thread, object and symbol, folded twice.
pub fn summarise(
    data: &Path,
    scenario: &str,
    delivered_pps: f64,
    ns_per_packet: f64,
) -> Result<Profile> {
    let (samples, parts, top_symbols) = fold(&report(data, "comm,dso,sym")?);
    Ok(Profile {
        scenario: scenario.to_string(),
        samples,
        delivered_pps,
        ns_per_packet,
        parts,
        top_symbols,
    })
}

/// Named shares of all samples, in %, largest first.
type Shares = Vec<(String, f64)>;

/// `perf report --sort comm,dso,sym` lines ("worker-0 [kernel.kallsyms] [k] veth_xmit")
/// folded into the samples, the parts (`part_of`) and the hottest symbols, each share
/// a percentage of all samples, from the sample counts (not the lines' rounded shares).
fn fold(lines: &[ReportLine]) -> (u64, Shares, Shares) {
    let mut parts: Vec<(String, u64)> = Vec::new();
    let mut symbols: std::collections::HashMap<String, u64> = Default::default();
    let mut samples = 0;
    for (_, n, cols) in lines {
        samples += n;
        let (comm, dso, sym) = match cols.as_slice() {
            [c, d, _, s, ..] => (c.as_str(), d.as_str(), s.as_str()),
            [c, d, ..] => (c.as_str(), d.as_str(), ""),
            _ => continue,
        };
        let part = part_of(comm, dso, sym);
        match parts.iter_mut().find(|(p, _)| p == part) {
            Some((_, v)) => *v += n,
            None => parts.push((part.to_string(), *n)),
        }
        // The symbol after its marker ("[k]", "[.]"); a demangled one may hold spaces.
        let symbol = cols.get(3..).unwrap_or_default().join(" ");
        *symbols.entry(symbol).or_default() += n;
    }
    let share = |n: u64| 100.0 * n as f64 / samples.max(1) as f64;
    parts.sort_by_key(|p| std::cmp::Reverse(p.1));
    let mut symbols: Vec<(String, u64)> = symbols.into_iter().collect();
    symbols.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (
        samples,
        parts.into_iter().map(|(p, n)| (p, share(n))).collect(),
        symbols
            .into_iter()
            .take(TOP_SYMBOLS)
            .map(|(s, n)| (s, share(n)))
            .collect(),
    )
}

/// The report's section.
pub fn markdown(profiles: &[Profile], note: &str) -> String {
    let mut m = String::from("\n## Where the time goes (perf record of the path core)\n\n");
    if profiles.is_empty() {
        m += &format!("Not profiled in this run{note}.\n");
        return m;
    }
    m += "One extra window per path after the rounds (and one of juneau at the largest flow count of its flow-scale rows, its flows created first), at the offered rate of its rounds (`perf record -C <path core>`: cpu-clock samples, this VM has no PMU); the samples by thread, object and symbol folded into parts (an XDP program's helpers, its map look-ups and clock, apart from the veths' receive); a part's ns per packet = its share of the busy samples x the window's ns of path core per delivered packet.\n\n";
    for p in profiles {
        let idle: f64 = p
            .parts
            .iter()
            .filter(|(n, _)| n == "idle")
            .map(|(_, v)| v)
            .sum();
        let busy = 100.0 - idle;
        m += &format!(
            "**{}** ({:.0} pps delivered, {:.0} ns of path core per packet in the profiled window; the core idle {idle:.0}% of it):\n\n| part | share of the busy time | ns per packet |\n|---|---:|---:|\n",
            p.scenario, p.delivered_pps, p.ns_per_packet
        );
        for (name, share) in p.parts.iter().filter(|(n, _)| n != "idle") {
            let (pct, ns) = if busy > 0.0 {
                (100.0 * share / busy, share / busy * p.ns_per_packet)
            } else {
                (0.0, 0.0)
            };
            m += &format!("| {name} | {pct:.1}% | {ns:.0} |\n");
        }
        m += "\nHottest symbols: ";
        m += &p
            .top_symbols
            .iter()
            .map(|(s, v)| format!("`{s}` {v:.1}%"))
            .collect::<Vec<_>>()
            .join(", ");
        m += "\n\n";
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `argv` pinned to `cpu` for `secs` (output discarded).
    fn busy_on(cpu: u32, secs: &str, argv: &[&str]) {
        let cpu = cpu.to_string();
        let mut a = vec![secs, "taskset", "-c", cpu.as_str()];
        a.extend_from_slice(argv);
        // `timeout` ends it (exit 124): that is the point.
        Command::new("timeout")
            .args(&a)
            .stdout(Stdio::null())
            .status()
            .expect("timeout");
    }

    /// Needs root and perf (in tests/setup's packages). Work on the recorded CPU before
    /// `enable` and after `disable` leaves no sample; the work between does.
    #[test]
    fn a_recorder_samples_only_between_enable_and_disable() {
        juneau_tests::netns::require_root().expect("root");
        assert!(
            available(),
            "perf is not installed (tests/setup/apt-packages.txt)"
        );
        let cpu = (std::thread::available_parallelism().map_or(1, |n| n.get()) - 1) as u32;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("p.data");
        let mut r = Recorder::start(cpu, &data).unwrap();
        busy_on(cpu, "0.5", &["yes"]);
        r.enable().unwrap();
        busy_on(cpu, "0.5", &["sh", "-c", "while :; do :; done"]);
        r.disable().unwrap();
        busy_on(cpu, "0.5", &["yes"]);
        r.finish().unwrap();
        let lines = report(&data, "comm").unwrap();
        let samples = |comm: &str| -> u64 {
            lines
                .iter()
                .filter(|(_, _, cols)| cols.first().is_some_and(|c| c == comm))
                .map(|(_, n, _)| n)
                .sum()
        };
        assert!(samples("sh") > 20, "{lines:?}");
        assert_eq!(samples("yes"), 0, "{lines:?}");
    }

    #[test]
    fn report_lines_are_parsed_and_folded_into_parts() {
        let text = "# comment\n#\n    52.17%  12611  worker-0         [kernel.kallsyms]  [k] xsk_destruct_skb\n    22.78%  5507  napi/jprf291660  [kernel.kallsyms]  [k] __pi_memcpy\n    14.10%  3409  swapper          [kernel.kallsyms]  [k] pv_native_safe_halt\n     4.98%  1204  napi/jprf291660  bpf_prog_df04b7a8873560b3_juneau_steer  [k] bpf_prog_df04b7a8873560b3_juneau_steer\n     4.22%  1020  worker-0         juneau-dataplane  [.] juneau_dataplane::runtime::worker::receive\n     0.72%  174  worker-0         libc.so.6  [.] __libc_sendto\n     0.25%  60  napi/jprf291660  [kernel.kallsyms]  [k] htab_map_hash\n\n";
        let lines = parse_report(text);
        assert_eq!(lines.len(), 7);
        assert_eq!((lines[0].0, lines[0].1), (52.17, 12611));
        let parts: Vec<&str> = lines
            .iter()
            .map(|(_, _, c)| part_of(&c[0], &c[1], &c[3]))
            .collect();
        assert!(parts[0].starts_with("forwarder's system calls"));
        assert!(parts[1].starts_with("NAPI kthreads"));
        assert_eq!(parts[2], "idle");
        assert!(parts[3].starts_with("XDP steering program"));
        assert!(parts[4].starts_with("forwarder in userspace"));
        assert!(parts[5].starts_with("forwarder in userspace"));
        assert!(parts[6].starts_with("XDP programs' helpers"), "{parts:?}");
        // A kernel path: everything in the NAPI kthread; l2fwd's own program is not ours.
        let napi = |dso, sym| part_of("napi/x-1", dso, sym);
        assert!(napi("bpf_prog_e225_xsk_steer", "").starts_with("XDP steering"));
        assert!(napi("bpf_prog_e7fb_xdp_sink", "").starts_with("NAPI kthreads"));
        assert!(napi("[kernel.kallsyms]", "__nf_conntrack_find_get").starts_with("NAPI"));
        assert!(napi("[kernel.kallsyms]", "lookup_nulls_elem_raw").starts_with("XDP programs'"));
        // The same symbol in the forwarder's own system call is its system call's.
        assert!(part_of("worker-0", "[kernel.kallsyms]", "htab_map_hash")
            .starts_with("forwarder's system calls"));
    }

    #[test]
    fn a_symbol_is_summed_over_threads_and_shares_come_from_sample_counts() {
        let text = "    60.00%  600  worker-0  [kernel.kallsyms]  [k] xsk_destruct_skb\n    30.00%  300  napi/x-1  [kernel.kallsyms]  [k] xsk_destruct_skb\n    10.00%  100  worker-0  juneau-dataplane  [.] <impl juneau::Engine>::sweep\n";
        let (samples, parts, top) = fold(&parse_report(text));
        assert_eq!(samples, 1000);
        assert_eq!(top[0], ("xsk_destruct_skb".to_string(), 90.0));
        assert_eq!(top[1], ("<impl juneau::Engine>::sweep".to_string(), 10.0));
        assert!(parts[0].0.starts_with("forwarder's system calls") && parts[0].1 == 60.0);
        assert!(parts[1].0.starts_with("NAPI kthreads") && parts[1].1 == 30.0);
    }

    #[test]
    fn the_section_gives_each_part_its_ns_per_packet() {
        let p = Profile {
            scenario: "juneau".into(),
            samples: 100,
            delivered_pps: 1e6,
            ns_per_packet: 1000.0,
            parts: vec![
                ("forwarder's system calls".into(), 40.0),
                ("NAPI kthreads".into(), 40.0),
                ("idle".into(), 20.0),
            ],
            top_symbols: vec![("sendto".into(), 10.0)],
        };
        let md = markdown(&[p], "");
        assert!(
            md.contains("| forwarder's system calls | 50.0% | 500 |"),
            "{md}"
        );
        assert!(md.contains("the core idle 20% of it"), "{md}");
        assert!(!md.contains("| idle |"), "{md}");
        assert!(markdown(&[], ": perf not installed")
            .contains("Not profiled in this run: perf not installed."));
    }
}
