//! The control-plane scale measurement's record ([`ScaleReport`]) and its report
//! section. The `scale` module measures it.

use serde::{Deserialize, Serialize};

/// Memory of one process.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Rss {
    /// Process.
    pub name: String,
    /// Resident set now, MiB.
    pub rss_mib: f64,
    /// Peak resident set, MiB.
    pub peak_mib: f64,
}

/// What the scale run measured (seconds from `t0`; None = not reached in time).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScaleReport {
    /// Services created.
    pub services: u32,
    /// Endpoints per Service (all ready, all on the one node).
    pub endpoints_per_service: u32,
    /// Time to create every Service and EndpointSlice (client side, 32 in flight). With
    /// `precreated`, before `t0` (not part of the other figures).
    pub create_s: f64,
    /// Everything was created before the Juneau daemons started; `t0` = their start.
    #[serde(default)]
    pub precreated: bool,
    /// Creates retried after the apiserver answered 5xx or 429.
    #[serde(default)]
    pub create_retries: u64,
    /// Every Service shows its VIP.
    pub all_vips_s: Option<f64>,
    /// Every ServiceLoadBalancer has condition Ready=True.
    pub all_ready_s: Option<f64>,
    /// The agent's shared memory advertises every VIP.
    pub shm_all_advertised_s: Option<f64>,
    /// Publishes the agent made until then.
    pub agent_publishes: u64,
    /// The agent's CPU time over the run, s (user + system).
    pub agent_cpu_s: f64,
    /// The controller's CPU time over the run, s.
    pub controller_cpu_s: f64,
    /// juneau-bgp's CPU time over the run, s.
    #[serde(default)]
    pub speaker_cpu_s: f64,
    /// juneau-perf's own CPU time over the run (its creates, watches and observers), s:
    /// it shares the 2 cores with what it measures.
    #[serde(default)]
    pub harness_cpu_s: f64,
    /// Size of the state file at the end, bytes.
    pub state_file_bytes: u64,
    /// BIRD has every /32 in its table.
    pub bird_all_routes_s: Option<f64>,
    /// Memory of each process at the end.
    pub memory: Vec<Rss>,
    /// Goal for `all_ready_s` with `precreated`.
    pub goal_s: f64,
    /// How it was measured.
    pub method: String,
    /// Where the bed's logs were kept (controller, agent, juneau-bgp, BIRD,
    /// kube-apiserver, etcd), relative to the report's directory.
    #[serde(default)]
    pub logs: String,
    /// kube-apiserver's CPU time over the run, s (from the start of the measurement).
    #[serde(default)]
    pub apiserver_cpu_s: f64,
    /// etcd's CPU time over the run, s.
    #[serde(default)]
    pub etcd_cpu_s: f64,
    /// Requests the apiserver served over the run, by verb and resource (its own
    /// `apiserver_request_total`, every client: controller, agent, juneau-perf's watches
    /// and, without `precreated`, its creates), most first.
    #[serde(default)]
    pub api_requests: Vec<ApiRequests>,
    /// Without `precreated`: the apiserver alone (no Juneau daemon running) creating the
    /// same Services and EndpointSlices with the same client code, on the same bed before
    /// the daemons started, s (the baseline of [`LIVE_GOAL_RATIO`]).
    #[serde(default)]
    pub apiserver_alone_create_s: Option<f64>,
    /// kube-apiserver's CPU time over that baseline's creates, s.
    #[serde(default)]
    pub apiserver_alone_cpu_s: Option<f64>,
    /// API writes per Service made by Juneau's controller and agent over the run: the
    /// apiserver's non-read requests less juneau-perf's own creates (and the resources
    /// only the apiserver writes), / `services`. None: the request counts are missing.
    #[serde(default)]
    pub juneau_writes_per_service: Option<f64>,
}

/// Live (not `precreated`): every ServiceLoadBalancer Ready within this many times the
/// apiserver alone creating the objects.
pub const LIVE_GOAL_RATIO: f64 = 1.2;
/// Juneau's API writes per Service, at most.
pub const WRITES_GOAL: f64 = 3.0;

/// Requests of one verb on one resource, as the apiserver counted them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ApiRequests {
    /// GET, LIST, WATCH, POST, PATCH, APPLY, PUT, DELETE ...
    pub verb: String,
    /// `resource` or `resource/subresource` (`services/status`).
    pub resource: String,
    /// How many.
    pub count: u64,
}

/// Where the bed's logs are kept: `<out>/scale-logs`.
pub const LOG_DIR: &str = "scale-logs";

/// The report section.
pub fn markdown(r: &ScaleReport) -> String {
    let f = |v: Option<f64>| {
        v.map(|x| format!("{x:.1} s"))
            .unwrap_or_else(|| "**not reached**".into())
    };
    let mut m = format!(
        "{} Services x {} endpoints. {}.\n\n| from t0 to | time |\n|---|---:|\n",
        r.services, r.endpoints_per_service, r.method
    );
    m += &format!(
        "| every Service and EndpointSlice created | {}{:.1} s ({} creates retried after a 5xx/429) |\n",
        if r.precreated { "before t0, in " } else { "" },
        r.create_s,
        r.create_retries
    );
    if let Some(b) = r.apiserver_alone_create_s {
        let cpu = r.apiserver_alone_cpu_s.map_or(String::new(), |c| {
            format!(", kube-apiserver {c:.1} s of CPU")
        });
        m += &format!(
            "| baseline, before the daemons: the apiserver alone creating them all | {b:.1} s (not from t0){cpu} |\n"
        );
    }
    m += &format!("| every Service shows its VIP | {} |\n", f(r.all_vips_s));
    let goal = match (r.precreated, r.apiserver_alone_create_s) {
        (true, _) => format!(" (goal <= {:.0} s)", r.goal_s),
        (false, Some(b)) => format!(
            " (goal <= {LIVE_GOAL_RATIO} x the apiserver alone = {:.1} s)",
            LIVE_GOAL_RATIO * b
        ),
        (false, None) => String::new(),
    };
    m += &format!(
        "| every ServiceLoadBalancer Ready{goal} | {} |\n",
        f(r.all_ready_s)
    );
    m += &format!(
        "| the agent's shared memory advertises every VIP | {} |\n",
        f(r.shm_all_advertised_s)
    );
    m += &format!("| BIRD has every /32 | {} |\n", f(r.bird_all_routes_s));
    m += &format!(
        "\nAgent: {} publishes until all were advertised, {:.1} s CPU over the run ({:.0} ms CPU per publish on average); \
         state file {:.1} MiB. Controller: {:.1} s CPU. juneau-bgp: {:.1} s CPU. juneau-perf itself \
         (creates, watches, observers; on the same 2 cores): {:.1} s CPU.\n\n| process | RSS MiB | peak RSS MiB |\n|---|---:|---:|\n",
        r.agent_publishes,
        r.agent_cpu_s,
        if r.agent_publishes > 0 { 1e3 * r.agent_cpu_s / r.agent_publishes as f64 } else { 0.0 },
        r.state_file_bytes as f64 / (1 << 20) as f64,
        r.controller_cpu_s,
        r.speaker_cpu_s,
        r.harness_cpu_s
    );
    for x in &r.memory {
        m += &format!("| {} | {:.0} | {:.0} |\n", x.name, x.rss_mib, x.peak_mib);
    }
    if !r.api_requests.is_empty() {
        m += &format!(
            "\nkube-apiserver: {:.1} s CPU, etcd: {:.1} s CPU over the run. Requests the apiserver \
             served from the start of the measurement to its end (its `apiserver_request_total`, \
             every client; per Service = count / {}):\n\n| verb | resource | requests | per Service |\n|---|---|---:|---:|\n",
            r.apiserver_cpu_s, r.etcd_cpu_s, r.services
        );
        for q in r.api_requests.iter().take(20) {
            m += &format!(
                "| {} | {} | {} | {:.2} |\n",
                q.verb,
                q.resource,
                q.count,
                q.count as f64 / f64::from(r.services.max(1))
            );
        }
    }
    if let Some(w) = r.juneau_writes_per_service {
        m += &format!(
            "\nJuneau's API writes per Service (controller and agent; goal <= {WRITES_GOAL:.0}): **{w:.2}**.\n"
        );
    }
    if !r.logs.is_empty() {
        m += &format!(
            "\nLogs of the controller, agent, juneau-bgp, BIRD, kube-apiserver and etcd: `{LOG_DIR}/`.\n"
        );
    }
    m
}
