// SPDX-License-Identifier: Apache-2.0
// Juneau's XDP steering program.
//
// Attached to the uplink and to every Pod-facing interface. It redirects to the
// interface's AF_XDP socket only what belongs to Juneau:
//   - on the uplink: IPv4 TCP/UDP packets to a VIP:port/proto a Service exposes (map
//     `frontends`), ICMP errors quoting a packet from such a VIP:port, and fragments /
//     packets with IP options to a VIP (userspace counts and drops them). Anything else
//     to a VIP address (an unexposed port, ICMP echo, other protocols) is dropped here
//     and counted in `steer_drops`: the node owns no VIP address, so the kernel would
//     only route it back towards the router.
//   - on a Pod interface: IPv4 TCP/UDP packets that are the reply of a flow the
//     dataplane holds (reverse key found in the shared flow table `flow_index` /
//     `flow_records`), and ICMP errors quoting a packet of such a flow.
// Everything else -- kubelet probes, Pod-to-Pod, a Pod's own outbound connections,
// ARP, IPv6, BGP, SSH -- and any packet whose TTL would expire returns XDP_PASS.
//
// A redirect to an empty AF_XDP slot (the dataplane process is down) drops the packet
// (`XDP_DROP` as the redirect fallback): TCP retransmits until the process is back.
//
// The flow table is written by userspace only (through mmap); this program only reads
// it. See docs/dataplane.md "Flow table" for the concurrency argument.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ROLE_UPLINK 0
#define ROLE_POD 1

// Must match `flow::FLOW_MAGIC` / `flow::LAYOUT_VERSION` and the record layout.
#define FLOW_MAGIC 0x4a554e4541554654ULL // "JUNEAUFT"
#define FLOW_LAYOUT_VERSION 2
// Most flow tables (forwarding workers); `flow::MAX_WORKERS`.
#define MAX_WORKERS 16
// Longest probe; userspace never places a key further than this from its home slot.
#define MAX_PROBE 128

// steer_drops indexes.
#define SD_PORT_NOT_EXPOSED 0
#define SD_UNSUPPORTED_PROTOCOL 1

struct iface_conf {
	__u32 slot_base; // xsks index of the socket on RX queue 0 of this interface
	__u32 queues;    // sockets (RX queues) of this interface: slot_base + queue
	__u32 role;      // ROLE_*
};

struct frontend_key {
	__u32 addr; // network order
	__u16 port; // network order
	__u8 proto;
	__u8 pad;
};

// The shared flow tables' headers (`flow::FlowMeta`), one per forwarding worker: table w
// owns index slots [w * index_slots, (w + 1) * index_slots) and records
// [w * capacity, (w + 1) * capacity); its index slots hold record numbers within its part.
struct flow_meta {
	__u64 magic;
	__u32 layout;
	__u32 capacity;
	__u32 index_slots;
	__u32 seq; // odd while userspace moves index slots
	__u64 seed;
	__u64 seed2;
	__u32 workers; // tables in the group, one per forwarding worker
	__u32 table;   // this table's number: its part of flow_index / flow_records
	__u64 reserved[2];
};

// One flow record (`flow::Flow`), host byte order.
struct flow {
	__u32 client;
	__u32 vip;
	__u32 backend;
	__u16 client_port;
	__u16 vip_port;
	__u16 backend_port;
	__u8 proto;
	__u8 state; // 0: free
	__u32 slot;
	__u32 checked_generation;
	__u32 expires; // CLOCK_MONOTONIC milliseconds, wrapping
};

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u32); // ifindex
	__type(value, struct iface_conf);
} ifaces SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); // VIP, network order
	__type(value, __u8);
} vips SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct frontend_key);
	__type(value, __u8);
} frontends SEC(".maps");

// Sized at load time (one entry per worker).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flow_meta);
} flow_meta SEC(".maps");

// Sized at load time (`--flow-capacity`).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} flow_index SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flow);
} flow_records SEC(".maps");

// This node's redirect endpoint(s) (issue 12): UDP to one of these `addr:port` on the
// uplink carries a packet another node redirected here, or a notice.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, struct frontend_key);
	__type(value, __u8);
} redirect_in SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, __u64);
} steer_drops SEC(".maps");

static __always_inline int count_drop(__u32 reason)
{
	__u64 *c = bpf_map_lookup_elem(&steer_drops, &reason);
	if (c)
		*c += 1;
	return XDP_DROP;
}

// The index hash of `flow::FlowTable::hash_raw`: the 64x64->128-bit product of the
// seeded key halves, high and low halves folded, then folded to 32 bits. BPF has no
// 128-bit multiply, so it is built from four 32x32->64 products.
static __always_inline __u32 flow_hash(__u64 a, __u64 b)
{
	__u64 al = (__u32)a, ah = a >> 32, bl = (__u32)b, bh = b >> 32;
	__u64 ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
	__u64 mid = (ll >> 32) + (__u32)lh + (__u32)hl;
	__u64 lo = (__u32)ll | (mid << 32);
	__u64 hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
	__u64 h = lo ^ hi;
	return (__u32)(h ^ (h >> 32));
}

// Whether table `m` (number `w`) holds a flow whose reverse key (backend -> client) is
// this 5-tuple: 1 yes or unsure, 0 no.
static __always_inline int held_in(struct flow_meta *m, __u32 w, __u32 h, __u32 src, __u32 dst,
				   __u16 sp, __u16 dp, __u8 proto, __u32 now)
{
	__u32 seq = *(volatile __u32 *)&m->seq;
	if (seq & 1)
		return 1;
	__u32 mask = m->index_slots - 1;
	__u32 ibase = w * m->index_slots, rbase = w * m->capacity;
	for (__u32 i = 0; i < MAX_PROBE; i++) {
		__u32 at = ibase + ((h + i) & mask);
		__u64 *slotp = bpf_map_lookup_elem(&flow_index, &at);
		if (!slotp)
			return 1;
		__u64 slot = *(volatile __u64 *)slotp;
		if (slot == 0) {
			// Miss, unless an index slot moved meanwhile.
			__u32 seq2 = *(volatile __u32 *)&m->seq;
			return seq2 != seq;
		}
		if ((__u32)(slot >> 32) != h)
			continue;
		__u32 low = (__u32)slot - 1;
		if ((low & 1) != 1) // a forward (client -> VIP) key
			continue;
		__u32 id = rbase + (low >> 1);
		struct flow *f = bpf_map_lookup_elem(&flow_records, &id);
		if (!f)
			continue;
		if (f->state != 0 && f->backend == src && f->client == dst &&
		    f->backend_port == sp && f->client_port == dp && f->proto == proto &&
		    (__s32)(f->expires - now) > 0)
			return 1;
	}
	return 1; // probe limit: let userspace decide
}

// A reply look-up across the tables (`bpf_loop` context).
struct probe_ctx {
	__u32 h, src, dst, workers, now;
	__u16 sp, dp;
	__u8 proto;
	int held;
};

// Probes table `w`; stops the loop (1) past the last table or once the answer is yes.
static long probe_table(__u32 w, void *data)
{
	struct probe_ctx *c = data;
	if (w >= c->workers)
		return 1;
	struct flow_meta *t = bpf_map_lookup_elem(&flow_meta, &w);
	if (!t || t->magic != FLOW_MAGIC || t->layout != FLOW_LAYOUT_VERSION) {
		c->held = 1; // being (re)initialised: let userspace decide
		return 1;
	}
	if (held_in(t, w, c->h, c->src, c->dst, c->sp, c->dp, c->proto, c->now)) {
		c->held = 1;
		return 1;
	}
	return 0;
}

// Whether the dataplane holds a flow whose reverse key (backend -> client) is this
// 5-tuple, given as the packet holds it (network order), in any worker's table.
// Conservative: whenever the answer is uncertain (userspace was moving index slots, the
// probe limit was reached) it says yes, so the packet goes to userspace, which decides
// exactly (and drops what has no flow). It never says no for a flow that is held.
static __always_inline int reply_of_held_flow(__be32 saddr, __be32 daddr, __be16 sport,
					      __be16 dport, __u8 proto)
{
	__u32 zero = 0;
	struct flow_meta *m = bpf_map_lookup_elem(&flow_meta, &zero);
	if (!m)
		return 0;
	if (m->magic != FLOW_MAGIC || m->layout != FLOW_LAYOUT_VERSION)
		return 0; // no table (yet): nothing is held
	// Every table uses the same seeds (userspace hashes a key once for all of them).
	__u64 addrs = (__u64)saddr | ((__u64)daddr << 32);
	__u32 ports = (__u32)sport | ((__u32)dport << 16);
	__u32 h = flow_hash(addrs ^ m->seed, ((__u64)ports | ((__u64)proto << 32)) ^ m->seed2);
	struct probe_ctx c = {
		.h = h,
		.src = bpf_ntohl(saddr),
		.dst = bpf_ntohl(daddr),
		.workers = m->workers,
		.now = (__u32)(bpf_ktime_get_ns() / 1000000),
		.sp = bpf_ntohs(sport),
		.dp = bpf_ntohs(dport),
		.proto = proto,
		.held = 0,
	};
	// One callback per table (bpf_loop): each is verified once, and the table number
	// is a plain argument rather than a loop counter the verifier must tell apart.
	bpf_loop(MAX_WORKERS, probe_table, &c, 0);
	return c.held;
}

static __always_inline int uplink(struct iphdr *ip, void *end, __u32 slot)
{
	if (!bpf_map_lookup_elem(&vips, &ip->daddr)) {
		// Redirects from other nodes (whole datagrams without IP options only).
		if (ip->protocol != IPPROTO_UDP || ip->ihl != 5 ||
		    (ip->frag_off & bpf_htons(0x3fff)))
			return XDP_PASS;
		__be16 *rp = (void *)(ip + 1);
		if ((void *)(rp + 2) > end)
			return XDP_PASS;
		struct frontend_key rk = { .addr = ip->daddr, .port = rp[1],
					   .proto = IPPROTO_UDP, .pad = 0 };
		if (!bpf_map_lookup_elem(&redirect_in, &rk))
			return XDP_PASS;
		return bpf_redirect_map(&xsks, slot, XDP_DROP);
	}
	if (ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)))
		return bpf_redirect_map(&xsks, slot, XDP_DROP); // counted by userspace
	struct frontend_key key = { .addr = ip->daddr, .proto = ip->protocol, .pad = 0 };
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		__be16 *ports = (void *)(ip + 1);
		if ((void *)(ports + 2) > end)
			return bpf_redirect_map(&xsks, slot, XDP_DROP); // malformed: counted
		key.port = ports[1];
		if (!bpf_map_lookup_elem(&frontends, &key))
			return count_drop(SD_PORT_NOT_EXPOSED);
		return bpf_redirect_map(&xsks, slot, XDP_DROP);
	}
	if (ip->protocol != IPPROTO_ICMP)
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	// An ICMP error (unreachable incl. fragmentation needed, time exceeded) about a
	// reply we sent: the quoted packet's source is VIP:port.
	__u8 *icmp = (void *)(ip + 1);
	struct iphdr *q = (void *)(icmp + 8);
	if ((void *)(q + 1) + 4 > end)
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	if ((icmp[0] != 3 && icmp[0] != 11) || q->ihl != 5)
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	if (q->protocol != IPPROTO_TCP && q->protocol != IPPROTO_UDP)
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	__be16 *qports = (void *)(q + 1);
	key.addr = q->saddr;
	key.port = qports[0];
	key.proto = q->protocol;
	if (!bpf_map_lookup_elem(&frontends, &key))
		return count_drop(SD_PORT_NOT_EXPOSED);
	return bpf_redirect_map(&xsks, slot, XDP_DROP);
}

static __always_inline int pod(struct iphdr *ip, void *end, __u32 slot)
{
	if (ip->frag_off & bpf_htons(0x1fff))
		return XDP_PASS; // a later fragment: no ports to match (see docs)
	__u32 ihl = (ip->ihl & 0xf) * 4;
	if (ihl < sizeof(*ip))
		return XDP_PASS;
	__u8 *l4 = (__u8 *)ip + ihl;
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		__be16 *ports = (void *)l4;
		if ((void *)(ports + 2) > end)
			return XDP_PASS;
		if (!reply_of_held_flow(ip->saddr, ip->daddr, ports[0], ports[1], ip->protocol))
			return XDP_PASS;
		// First fragments and packets with options of a flow go too: userspace
		// counts and drops them rather than let the kernel route them un-NATed.
		return bpf_redirect_map(&xsks, slot, XDP_DROP);
	}
	if (ip->protocol != IPPROTO_ICMP || ihl != sizeof(*ip))
		return XDP_PASS;
	// An ICMP error a backend sends about a packet of a flow (client -> backend): the
	// quoted packet reversed is the flow's reverse key.
	struct iphdr *q = (void *)(l4 + 8);
	if ((void *)(q + 1) + 4 > end)
		return XDP_PASS;
	if ((l4[0] != 3 && l4[0] != 11) || q->ihl != 5)
		return XDP_PASS;
	if (q->protocol != IPPROTO_TCP && q->protocol != IPPROTO_UDP)
		return XDP_PASS;
	__be16 *qports = (void *)(q + 1);
	if (!reply_of_held_flow(q->daddr, q->saddr, qports[1], qports[0], q->protocol))
		return XDP_PASS;
	return bpf_redirect_map(&xsks, slot, XDP_DROP);
}

SEC("xdp")
int juneau_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return XDP_PASS;
	__u32 ifindex = ctx->ingress_ifindex;
	struct iface_conf *conf = bpf_map_lookup_elem(&ifaces, &ifindex);
	if (!conf)
		return XDP_PASS;
	if (ip->ttl <= 1)
		return XDP_PASS; // the kernel answers with ICMP time exceeded
	__u32 queue = ctx->rx_queue_index;
	__u32 slot = conf->slot_base + queue;
	if (queue >= conf->queues)
		slot = 0xffffffff; // no socket on this queue: what is ours is dropped
	if (conf->role == ROLE_UPLINK)
		return uplink(ip, end, slot);
	return pod(ip, end, slot);
}

// No GPL-only helper is used, so the project licence is stated as is.
char LICENSE[] SEC("license") = "Apache-2.0";
