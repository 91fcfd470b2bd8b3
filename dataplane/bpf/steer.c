// SPDX-License-Identifier: Apache-2.0
// Juneau's XDP steering program.
//
// Attached to the uplink and to every Pod-facing interface. It redirects to the
// interface's AF_XDP socket only what belongs to Juneau:
//   - on the uplink: IPv4 TCP/UDP packets to a VIP:port/proto a Service exposes (map
//     `frontends`; packets of a flow a table holds skip that look-up: fast-pathed, or
//     to userspace, which re-validates the flow) -- from a source its Service admits
//     (`loadBalancerSourceRanges`: map `source_ranges`; others are dropped and counted
//     as SD_SOURCE_RANGE_DENIED), ICMP errors quoting a packet from such
//     a VIP:port, and fragments /
//     packets with IP options to a VIP (userspace counts and drops them), and UDP to
//     this node's redirect address:port from a peer node (`redirect_in`, `redirect_from`;
//     from any other source it is dropped and counted). Anything else
//     to a VIP address (an unexposed port, ICMP echo, other protocols) is dropped here
//     and counted in `steer_drops`: the node owns no VIP address, so the kernel would
//     only route it back towards the router.
//   - on a Pod interface: IPv4 TCP/UDP packets that are the reply of a flow the
//     dataplane holds (reverse key found in the shared flow table `flow_index` /
//     `flow_records`), and ICMP errors quoting a packet of such a flow.
//   - IPv6 (`steer6`, a subprogram of its own; issue #28, docs/ipv6-steering.md): on
//     the uplink, TCP/UDP (directly after the fixed header) of a flow userspace holds
//     (forward key in `flows6`), or to an exposed VIP:port (`frontends6`; new flows
//     within the admission of their source /64), ICMPv6 errors quoting a packet from
//     such a VIP:port, and any other next header to a VIP (`vips6`: extension headers,
//     which userspace walks and counts); the rest to a VIP is dropped and counted as
//     for IPv4. On a Pod interface: TCP/UDP whose key is in `flows6` (a held flow's
//     reply), ICMPv6 errors whose quoted packet reversed is such a key, and the
//     fragments of such a reply (`frag6_replies`). IPv6 source ranges are userspace's.
// Everything else -- kubelet probes, Pod-to-Pod, a Pod's own outbound connections,
// ARP, ICMPv6 neighbour discovery (always), BGP, SSH -- and any packet whose TTL or
// hop limit would expire returns XDP_PASS.
//
// Packets of established IPv4 flows take a fast path here when userspace has published it
// (map `fast_slots`, see `dataplane/src/fast.rs` and docs/dataplane.md "XDP fast path"):
// a packet of an established TCP flow (no SYN/FIN/RST) or of a UDP flow, whose record was
// checked against the service table the fast path was published for, is rewritten here
// -- a client's packet: DNAT; a backend's reply: reverse NAT, its partial (offload) L4
// checksum completed -- with TTL, checksums and MACs; its expiry is pushed out, its
// slot's counters are added to, and it is redirected straight to the backend's (or, for
// a reply, the client's next hop's) interface -- only to interfaces userspace found able
// to take XDP frames. Anything else (new flows, state changes, an unresolved next hop, a
// table being rewritten) goes to userspace as before, which stays the only writer of
// records. IPv6 never takes the fast path.
//
// A redirect to an empty AF_XDP slot (the dataplane process is down) drops the packet
// and counts it (`to_userspace`, SD_NO_SOCKET): TCP retransmits until the process is back.
//
// The flow table is written by userspace only (through mmap), `flows6` too (bpf()
// calls); this program only reads them. See docs/dataplane.md "Flow table" for the
// concurrency argument.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

// Every constant shared with Rust, and each shared struct's size: src/abi.rs, made into
// this header by build.rs.
#include "juneau_abi.h"

// Longest L4 segment whose partial checksum the program completes (64-byte chunks).
#define CSUM_CHUNKS 24

struct iface_conf {
	__u32 slot_base; // xsks index of the socket on RX queue 0 of this interface
	__u32 queues;    // sockets (RX queues) of this interface: slot_base + queue
	__u32 role;      // ROLE_* (userspace derives `uplinks` from it)
};

// The uplinks' ifindexes (0: unused) and configurations, a copy of the `ifaces` entries
// of role ROLE_UPLINK: every packet needs its interface's role, and this array is read
// inline where a look-up in the `ifaces` hash costs ~15 ns per packet; `ifaces` (the
// AF_XDP socket of the interface's queue) is looked up only for what a Pod interface
// sends to userspace.
struct uplink_set {
	__u32 ifindex[MAX_UPLINKS];
	struct iface_conf conf[MAX_UPLINKS]; // each uplink's `ifaces` entry, copied
};

struct frontend_key {
	__u32 addr; // network order
	__u16 port; // network order
	__u8 proto;
	__u8 pad;
};

// A source range of a frontend (`source_ranges`, longest-prefix match): the 64 bits of
// the frontend, then the range's leading bits of the client address; `prefixlen` is 64
// plus the range's prefix length, and a look-up asks with 96 and the packet's source.
struct source_range_key {
	__u32 prefixlen;
	struct frontend_key frontend;
	__u32 saddr; // network order
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

// The head of one table's part of `fast_slots` (`fast::FastHead`), written by the
// table's worker only.
struct fast_head {
	__u32 seq;	  // odd while the worker rewrites its part; 0: never published
	__u32 generation; // service-table generation the slots below were written for
	__u32 established_ms;
	__u32 udp_ms;
	__u32 egress_epoch;	// reply-egress entries of another epoch are not used
	__u32 complete_partial; // 1: complete replies' partial checksums
	__u32 reserved[10];
};

// One reply-egress entry (`fast::ReplyEgress`): where replies to a client go.
struct fast_egress {
	__u32 seq;   // odd while the worker rewrites the entry
	__u32 epoch; // == the head's egress_epoch: usable
	__u32 client; // host order
	__u32 ifindex; // egress towards the client (takes XDP frames); 0: none
	__u8 macs[12]; // destination then source MAC
	__u32 reserved[9];
};

// One `(service, backend)` slot (`fast::FastSlot`): where forward packets go, and the
// packets the fast path handled (the worker folds them into its service counters).
struct fast_slot {
	__u32 generation; // == the head's: usable
	__u32 ifindex;	  // egress towards the backend (takes XDP frames)
	__u8 macs[12];	  // destination then source MAC
	__u32 reserved;
	__u64 traffic_in;  // client -> backend: packets << 36 | bytes (`fast::TRAFFIC_PACKET`)
	__u64 traffic_out; // replies, packed the same way
	__u64 reserved2[3];
};

// The shared structs' sizes, as src/abi.rs states them (Rust asserts its own).
_Static_assert(sizeof(struct iface_conf) == IFACE_CONF_BYTES, "struct iface_conf");
_Static_assert(sizeof(struct uplink_set) == UPLINK_SET_BYTES, "struct uplink_set");
_Static_assert(sizeof(struct frontend_key) == FRONTEND_KEY_BYTES, "struct frontend_key");
_Static_assert(sizeof(struct source_range_key) == SOURCE_RANGE_KEY_BYTES, "struct source_range_key");
_Static_assert(sizeof(struct flow_meta) == FLOW_META_BYTES, "struct flow_meta");
_Static_assert(sizeof(struct flow) == FLOW_RECORD_BYTES, "struct flow");
_Static_assert(sizeof(struct fast_head) == FAST_ENTRY_BYTES, "struct fast_head");
_Static_assert(sizeof(struct fast_egress) == FAST_ENTRY_BYTES, "struct fast_egress");
_Static_assert(sizeof(struct fast_slot) == FAST_ENTRY_BYTES, "struct fast_slot");


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
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct uplink_set);
} uplinks SEC(".maps");

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
	__type(value, __u8); // FRONTEND_* bits
} frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct source_range_key);
	__type(value, __u8);
} source_ranges SEC(".maps");

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

// Sized at load time: FAST_STRIDE entries per table, the head first.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fast_slot);
} fast_slots SEC(".maps");

// This node's redirect endpoint(s): UDP to one of these `addr:port` on the
// uplink carries a packet another node redirected here, or a notice.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, struct frontend_key);
	__type(value, __u8);
} redirect_in SEC(".maps");

// The peer nodes redirected packets and notices are taken from (userspace writes every
// peer of every VIP, as the engine accepts them): UDP to `redirect_in`
// from any other source is dropped here (SD_REDIRECT_NOT_FROM_PEER), before it costs a
// ring slot and a wake-up.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __be32);
	__type(value, __u8);
} redirect_from SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 8);
	__type(key, __u32);
	__type(value, __u64);
} steer_drops SEC(".maps");

// New-flow admission: packets on the uplink that no table holds a flow for, to an
// exposed VIP:port, reach userspace at most `rate` per second per source /24 (IPv6: /64),
// with a burst. Userspace keeps the buckets (`admission.rs`, a cell-rate
// bucket per prefix slot) and debits them for each packet of no flow it sees; the program
// only reads them: while a prefix's slot says its next packet is not due yet
// (`admit_open`), its packets of no flow are dropped here (SD_NEW_FLOW_PREFIX_RATE),
// before they cost the AF_XDP ring. Only then does the program look the flow up (a
// prefix with tokens left pays no look-up); packets of held flows never meet the limit.
// Rate 0: no limit.
struct admit_conf {
	__u64 rate;	    // per second per prefix (0: off)
	__u64 tolerance_ns; // how far ahead of now a bucket may run: (burst - 1) periods
	__u64 seed;	    // of the prefixes' slots (`admit_slot`)
};
_Static_assert(sizeof(struct admit_conf) == ADMIT_CONF_BYTES, "struct admit_conf");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct admit_conf);
} admit_conf SEC(".maps");

// Per prefix slot: its bucket's theoretical arrival time, CLOCK_MONOTONIC ns (written by
// userspace only): a packet of no flow is admitted from `tat - tolerance_ns` on.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, ADMIT_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(map_flags, BPF_F_MMAPABLE);
} admit_open SEC(".maps");

// Datagrams a backend's reply was fragmented into (source, destination, IP id,
// protocol), recorded when the first fragment matches a flow's reverse key: their later
// fragments, which carry no ports, go to userspace too (`dataplane/src/frag.rs`), other
// later fragments (a Pod's own traffic) pass. LRU: bounded, the oldest forgotten.
struct frag_key {
	__u32 src;
	__u32 dst;
	__u16 id;
	__u8 proto;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct frag_key);
	__type(value, __u8);
} frag_replies SEC(".maps");

// ---- IPv6 maps (issue #28) ----

// An IPv6 frontend (`frontends6`): VIP, port (both network order), protocol. Its value
// has the `frontends` bits, but only FRONTEND_EXPOSED is used yet: userspace applies the
// source ranges of IPv6 frontends, and none is host-network.
struct frontend6_key {
	__u8 addr[16];
	__be16 port;
	__u8 proto;
	__u8 pad;
};

// A key of an IPv6 flow as a packet of one direction holds it (`flows6`), network order:
// the forward key (client -> VIP) and the reverse key (backend -> client) of each flow.
struct flow6_key {
	__u8 src[16];
	__u8 dst[16];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

// An IPv6 datagram a backend's reply was fragmented into: source, destination and the
// Fragment header's identification (`frag6_replies`).
struct frag6_key {
	__u8 src[16];
	__u8 dst[16];
	__be32 id;
};

_Static_assert(sizeof(struct frontend6_key) == FRONTEND6_KEY_BYTES, "struct frontend6_key");
_Static_assert(sizeof(struct flow6_key) == FLOW6_KEY_BYTES, "struct flow6_key");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct frontend6_key);
	__type(value, __u8); // FRONTEND_* bits
} frontends6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u8[16]); // VIP, network order
	__type(value, __u8);
} vips6 SEC(".maps");

// The IPv6 flows userspace holds (it alone writes them: each flow's two keys while it
// lives), each key's value the number of the forwarding worker holding it. Sized at load
// time (two keys per flow of `--flow-capacity`); not preallocated: its memory (~100 bytes
// a key) follows the IPv6 flows there are, not the capacity.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1);
	__type(key, struct flow6_key);
	__type(value, __u32);
} flows6 SEC(".maps");

// As `frag_replies`: fragmented replies of held IPv6 flows, their later fragments (which
// carry no ports) follow the first to userspace.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct frag6_key);
	__type(value, __u8);
} frag6_replies SEC(".maps");

static __always_inline struct frag_key frag_key_of(struct iphdr *ip)
{
	struct frag_key k = { .src = ip->saddr, .dst = ip->daddr, .id = ip->id,
			      .proto = ip->protocol, .pad = 0 };
	return k;
}

// Which build of this program (and of its maps' sizes) is pinned beside the maps, so that
// a restarted dataplane of the same build reuses the verified program instead of loading
// it again (the verifier takes ~2 s here; the node's connections wait for the restart).
// Written and read by userspace only.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} steer_build SEC(".maps");

static __always_inline int count_drop(__u32 reason)
{
	__u64 *c = bpf_map_lookup_elem(&steer_drops, &reason);
	if (c)
		*c += 1;
	return XDP_DROP;
}

// Hands the packet to userspace through the AF_XDP socket in `slot`. With no socket
// there (the dataplane restarting, or handing over to its successor; a queue not
// registered yet) it is dropped, and counted (SD_NO_SOCKET): a packet of Juneau's never
// reaches the kernel un-NATed.
static __always_inline int to_userspace(__u32 slot)
{
	long r = bpf_redirect_map(&xsks, slot, XDP_DROP);
	if (r != XDP_REDIRECT)
		return count_drop(SD_NO_SOCKET);
	return (int)r;
}

// The 64x64->128-bit product `a * b`: the high half returned, the low half in `lo`. BPF
// has no 128-bit multiply, so it is built from four 32x32->64 products.
static __always_inline __u64 mul128(__u64 a, __u64 b, __u64 *lo)
{
	__u64 al = (__u32)a, ah = a >> 32, bl = (__u32)b, bh = b >> 32;
	__u64 ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
	__u64 mid = (ll >> 32) + (__u32)lh + (__u32)hl;
	*lo = (__u32)ll | (mid << 32);
	return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
}

// The index hash of `flow::FlowTable::hash_raw`: the 128-bit product of the seeded key
// halves, high and low halves folded, then folded to 32 bits.
static __always_inline __u32 flow_hash(__u64 a, __u64 b)
{
	__u64 lo;
	__u64 h = mul128(a, b, &lo) ^ lo;
	return (__u32)(h ^ (h >> 32));
}

// floor(2^64 / 10^6): `ns * NS_TO_MS_MUL >> 64` is floor(ns / 10^6) or one less.
#define NS_TO_MS_MUL 18446744073709ULL

// CLOCK_MONOTONIC in milliseconds (wrapping, as `region::monotonic_ms`) at tick
// resolution (cheaper than bpf_ktime_get_ns, which reads the clock source), without a
// 64-bit division (~10 ns here): at most 1 ms behind; expiries are seconds apart.
static __always_inline __u32 coarse_ms(void)
{
	__u64 lo;
	return (__u32)mul128(bpf_ktime_get_coarse_ns(), NS_TO_MS_MUL, &lo);
}

#define FIND_MISS 0
#define FIND_HIT 1
#define FIND_UNSURE 2

// A flow look-up across the tables (`bpf_loop` context): the key as the packet holds
// it (host order), which of the record's keys to match, and the answer.
struct probe_ctx {
	__u32 h, src, dst, workers, now;
	__u16 sp, dp;
	__u8 proto;
	__u8 dir; // 0: forward key (client -> VIP), 1: reverse key (backend -> client)
	int result;   // FIND_*
	__u32 table;  // FIND_HIT: the table holding the flow
	__u32 record; // FIND_HIT: its record (index into flow_records)
};

static __always_inline int key_matches(struct flow *f, struct probe_ctx *c)
{
	if (c->dir)
		return f->backend == c->src && f->client == c->dst && f->backend_port == c->sp &&
		       f->client_port == c->dp && f->proto == c->proto;
	return f->client == c->src && f->vip == c->dst && f->client_port == c->sp &&
	       f->vip_port == c->dp && f->proto == c->proto;
}

// Looks the key up in table `m` (number `w`): FIND_HIT with the record, FIND_MISS, or
// FIND_UNSURE (userspace was moving index slots, or the probe limit was reached).
static __always_inline int find_in(struct flow_meta *m, __u32 w, struct probe_ctx *c)
{
	__u32 seq = *(volatile __u32 *)&m->seq;
	if (seq & 1)
		return FIND_UNSURE;
	__u32 mask = m->index_slots - 1;
	__u32 ibase = w * m->index_slots, rbase = w * m->capacity;
	for (__u32 i = 0; i < MAX_PROBE; i++) {
		__u32 at = ibase + ((c->h + i) & mask);
		__u64 *slotp = bpf_map_lookup_elem(&flow_index, &at);
		if (!slotp)
			return FIND_UNSURE;
		__u64 slot = *(volatile __u64 *)slotp;
		if (slot == 0) {
			// Miss, unless an index slot moved meanwhile.
			__u32 seq2 = *(volatile __u32 *)&m->seq;
			return seq2 != seq ? FIND_UNSURE : FIND_MISS;
		}
		if ((__u32)(slot >> 32) != c->h)
			continue;
		__u32 low = (__u32)slot - 1;
		if ((low & 1) != c->dir)
			continue;
		__u32 id = rbase + (low >> 1);
		struct flow *f = bpf_map_lookup_elem(&flow_records, &id);
		if (!f)
			continue;
		if (f->state != 0 && key_matches(f, c) && (__s32)(f->expires - c->now) > 0) {
			c->table = w;
			c->record = id;
			return FIND_HIT;
		}
	}
	return FIND_UNSURE;
}

// Probes table `w`; stops the loop (1) past the last table or once the answer is known.
static long probe_table(__u32 w, void *data)
{
	struct probe_ctx *c = data;
	if (w >= c->workers)
		return 1;
	struct flow_meta *t = bpf_map_lookup_elem(&flow_meta, &w);
	if (!t || t->magic != FLOW_MAGIC || t->layout != FLOW_LAYOUT_VERSION) {
		c->result = FIND_UNSURE; // being (re)initialised: let userspace decide
		return 1;
	}
	int r = find_in(t, w, c);
	if (r == FIND_MISS)
		return 0;
	c->result = r;
	return 1;
}

// Looks a 5-tuple (as the packet holds it, network order) up in every worker's table,
// as the forward key (`dir` 0) or the reverse key (`dir` 1) of a flow. Conservative:
// whenever the answer is uncertain it says FIND_UNSURE, so the packet goes to userspace,
// which decides exactly. It never says FIND_MISS for a flow that is held.
static __always_inline void find_flow(struct probe_ctx *c, __be32 saddr, __be32 daddr,
				      __be16 sport, __be16 dport, __u8 proto, __u8 dir)
{
	__u32 zero = 0;
	c->result = FIND_MISS;
	struct flow_meta *m = bpf_map_lookup_elem(&flow_meta, &zero);
	if (!m)
		return;
	if (m->magic != FLOW_MAGIC || m->layout != FLOW_LAYOUT_VERSION)
		return; // no table (yet): nothing is held
	// Every table uses the same seeds (userspace hashes a key once for all of them).
	__u64 addrs = (__u64)saddr | ((__u64)daddr << 32);
	__u32 ports = (__u32)sport | ((__u32)dport << 16);
	c->h = flow_hash(addrs ^ m->seed, ((__u64)ports | ((__u64)proto << 32)) ^ m->seed2);
	c->src = bpf_ntohl(saddr);
	c->dst = bpf_ntohl(daddr);
	c->workers = m->workers;
	c->now = coarse_ms();
	c->sp = bpf_ntohs(sport);
	c->dp = bpf_ntohs(dport);
	c->proto = proto;
	c->dir = dir;
	if (c->workers == 1) {
		// One forwarding worker (the default): its table directly, without the
		// helper call and the callback.
		c->result = find_in(m, 0, c);
		return;
	}
	// One callback per table (bpf_loop): each is verified once, and the table number
	// is a plain argument rather than a loop counter the verifier must tell apart.
	bpf_loop(MAX_WORKERS, probe_table, c, 0);
}

// Whether the dataplane holds (or may hold) a flow whose reverse key is this 5-tuple.
static __always_inline int reply_of_held_flow(__be32 saddr, __be32 daddr, __be16 sport,
					      __be16 dport, __u8 proto)
{
	struct probe_ctx c = {};
	find_flow(&c, saddr, daddr, sport, dport, proto, 1);
	return c.result != FIND_MISS;
}

// ---- The established-flow fast path ----

// One's-complement helpers over 16-bit words as memory holds them (the sum is
// byte-order independent, RFC 1071). They fold exactly where `packet::csum_delta`,
// `csum_delta_add`, `csum_apply` fold, so the bytes equal the engine's.
static __always_inline __u16 fold_all(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

static __always_inline __u16 fold_once(__u32 s)
{
	return (__u16)((s & 0xffff) + (s >> 16));
}

// `csum_delta` of an address change: the two words of `from` out, those of `to` in.
static __always_inline __u16 addr_delta(__be32 from, __be32 to)
{
	return fold_all((__u32)(__u16)~(__u16)from + (__u16)~(__u16)(from >> 16) + (__u16)to +
			(__u16)(to >> 16));
}

static __always_inline __u16 word_delta(__be16 from, __be16 to)
{
	return fold_all((__u32)(__u16)~from + to);
}

static __always_inline __u16 delta_add(__u16 a, __u16 b)
{
	return fold_once((__u32)a + b);
}

static __always_inline __u16 csum_apply(__u16 csum, __u16 delta)
{
	return ~fold_once((__u32)(__u16)~csum + delta);
}

// The TTL's word (TTL, protocol) as memory holds it drops by one in its first byte:
// `!0x0100` in network order.
static __always_inline __u16 ttl_delta(void)
{
	return (__u16)~bpf_htons(0x0100);
}

#define NO_FAST -1

// Where a packet the fast path takes goes, and what it does to it.
struct fast_plan {
	__u32 ifindex;
	__u8 macs[12];
	__be32 new_addr; // forward: the backend (new destination); reply: the VIP (new source)
	__be16 new_port;
	__u8 reply;	       // a backend's reply (reverse NAT)
	__u8 complete;	       // a reply whose partial L4 checksum is completed here
	__u16 l4_len;	       // IP total length - 20
	__u32 expires;
	struct fast_slot *slot; // counters
	struct flow *flow;
};

// The checks `packet::parse_fast` applies to a TCP/UDP packet with a 20-byte IP header,
// so the program takes only what the engine's fast path would: 0, or NO_FAST.
static __always_inline int l4_sane(struct iphdr *ip, void *end, __u8 *l4, struct fast_plan *p)
{
	__u32 total = bpf_ntohs(ip->tot_len);
	if ((void *)ip + total > end)
		return NO_FAST;
	if (ip->protocol == IPPROTO_TCP) {
		if (total < 40 || (void *)l4 + 20 > end)
			return NO_FAST;
		__u32 data_off = (l4[12] >> 4) * 4;
		if (data_off < 20 || data_off > total - 20)
			return NO_FAST;
	} else {
		if ((void *)l4 + 8 > end)
			return NO_FAST;
		__u32 udp_len = ((__u32)l4[4] << 8) | l4[5];
		if (udp_len < 8 || udp_len + 20 > total)
			return NO_FAST;
	}
	p->l4_len = total - 20;
	return 0;
}

// `packet::is_partial_checksum`: whether an L4 checksum field (host order) holds only
// the pseudo-header sum, as a veth with tx checksum offload hands it over.
static __always_inline int is_partial(__u16 field, __u32 src, __u32 dst, __u8 proto, __u16 l4_len)
{
	__u32 s = (src >> 16) + (src & 0xffff) + (dst >> 16) + (dst & 0xffff) + proto + l4_len;
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return field == (__u16)s || (field == 0 && s == 0xffff);
}

// Where replies to `client` go: table part `base`'s reply-egress entry for it (the
// engine's cache index), if the worker published one in this epoch.
static __always_inline int reply_egress(__u32 base, __u32 epoch, __u32 client, struct fast_plan *p)
{
	__u32 at = base + 1 + FAST_SLOTS + ((client * 0x9e3779b1U) >> 24) % FAST_EGRESS;
	struct fast_egress *e = (void *)bpf_map_lookup_elem(&fast_slots, &at);
	if (!e)
		return NO_FAST;
	__u32 seq = *(volatile __u32 *)&e->seq;
	if (seq & 1)
		return NO_FAST;
	if (e->epoch != epoch || e->client != client || e->ifindex == 0)
		return NO_FAST;
	p->ifindex = e->ifindex;
	__builtin_memcpy(p->macs, e->macs, 12);
	if (*(volatile __u32 *)&e->seq != seq)
		return NO_FAST;
	return 0;
}

// Another worker's reply-egress entry for a client (`bpf_loop` context). With several
// workers, a client's replies can all reach the socket of a worker that does not own
// the flow: that worker resolves the client in its own part, never in the owner's. Its
// entry serves the owner's flows as well: an entry depends only on the client's route
// and is valid in its own part's egress epoch.
struct egress_ctx {
	__u32 skip;    // the owner's table, already looked at
	__u32 workers; // parts to look at
	__u32 client;
	__u32 ifindex; // found: non-zero, with `macs`
	__u8 macs[12];
};

// Looks at part `w`'s entry for the client; stops the loop (1) past the last part or
// once one is found.
static long probe_egress(__u32 w, void *data)
{
	struct egress_ctx *x = data;
	if (w >= x->workers)
		return 1;
	if (w == x->skip)
		return 0;
	__u32 base = w * FAST_STRIDE;
	struct fast_head *head = bpf_map_lookup_elem(&fast_slots, &base);
	if (!head)
		return 1;
	__u32 seq = *(volatile __u32 *)&head->seq;
	if (seq == 0 || (seq & 1))
		return 0;
	struct fast_plan p = {};
	if (reply_egress(base, *(volatile __u32 *)&head->egress_epoch, x->client, &p))
		return 0;
	if (*(volatile __u32 *)&head->seq != seq)
		return 0;
	x->ifindex = p.ifindex;
	__builtin_memcpy(x->macs, p.macs, 12);
	return 1;
}

// Where replies to `client` go when the owner's part (table `owner`) has no entry:
// another worker's entry (`probe_egress`), or NO_FAST.
static __always_inline int other_egress(__u32 owner, __u32 workers, __u32 client,
					struct fast_plan *p)
{
	if (workers <= 1)
		return NO_FAST;
	struct egress_ctx x = { .skip = owner, .workers = workers, .client = client };
	bpf_loop(MAX_WORKERS, probe_egress, &x, 0);
	if (x.ifindex == 0)
		return NO_FAST;
	p->ifindex = x.ifindex;
	__builtin_memcpy(p->macs, x.macs, 12);
	return 0;
}

// The fast path's decision for a packet of a flow found in table `c->table`, record
// `c->record` (`c->dir`: 0 forward, 1 reply): 0 with `plan` filled in, or NO_FAST
// (nothing has been changed). Reads the table's head before and after (a seqlock): a
// worker rewriting its part meanwhile means NO_FAST.
static __always_inline int fast_plan(struct iphdr *ip, void *end, struct probe_ctx *c,
				     struct fast_plan *p)
{
	__u32 base = c->table * FAST_STRIDE;
	struct fast_head *head = bpf_map_lookup_elem(&fast_slots, &base);
	if (!head)
		return NO_FAST;
	__u32 seq = *(volatile __u32 *)&head->seq;
	if (seq == 0 || (seq & 1))
		return NO_FAST;
	__u32 generation = *(volatile __u32 *)&head->generation;
	struct flow *f = bpf_map_lookup_elem(&flow_records, &c->record);
	if (!f || f->checked_generation != generation || !key_matches(f, c))
		return NO_FAST;
	__u8 *l4 = (void *)(ip + 1);
	if (l4_sane(ip, end, l4, p))
		return NO_FAST;
	if (c->proto == IPPROTO_TCP) {
		if ((void *)l4 + 20 > end)
			return NO_FAST;
		if (f->state != STATE_ESTABLISHED || (l4[13] & (TCP_FIN | TCP_SYN | TCP_RST)))
			return NO_FAST;
		p->expires = c->now + head->established_ms;
	} else {
		if (f->state != STATE_UDP)
			return NO_FAST;
		p->expires = c->now + head->udp_ms;
	}
	__u32 slot = f->slot;
	if (slot >= FAST_SLOTS)
		return NO_FAST;
	__u32 at = base + 1 + slot;
	struct fast_slot *e = bpf_map_lookup_elem(&fast_slots, &at);
	if (!e)
		return NO_FAST;
	if (e->generation != generation)
		return NO_FAST;
	if (c->dir == 0) {
		if (e->ifindex == 0)
			return NO_FAST;
		p->ifindex = e->ifindex;
		__builtin_memcpy(p->macs, e->macs, 12);
		p->new_addr = bpf_htonl(f->backend);
		p->new_port = bpf_htons(f->backend_port);
	} else {
		if (reply_egress(base, head->egress_epoch, f->client, p) &&
		    other_egress(c->table, c->workers, f->client, p))
			return NO_FAST;
		p->reply = 1;
		p->new_addr = bpf_htonl(f->vip);
		p->new_port = bpf_htons(f->vip_port);
		__u16 *csum = (void *)(l4 + (c->proto == IPPROTO_TCP ? 16 : 6));
		if ((void *)(csum + 1) > end)
			return NO_FAST;
		__u16 field = bpf_ntohs(*csum);
		p->complete = head->complete_partial && (c->proto == IPPROTO_TCP || field != 0) &&
			      is_partial(field, c->src, c->dst, c->proto, p->l4_len);
	}
	if (*(volatile __u32 *)&head->seq != seq)
		return NO_FAST;
	p->slot = e;
	p->flow = f;
	return 0;
}

// The L4 checksum of a rewritten TCP/UDP packet computed from scratch, as
// `packet::l4_checksum` computes it (UDP: 0 sent as 0xffff), written to `csum`; the
// segment (`l4_len` bytes after a 20-byte IP header) is summed in 64-byte chunks. Words
// are summed as memory holds them (RFC 1071: the sum is byte-order independent). -1 when
// the segment cannot be read (the packet is then dropped: its header is already
// rewritten).
static __always_inline int complete_l4(struct xdp_md *ctx, struct iphdr *ip, __u16 *csum,
				       __u32 l4_len)
{
	__u32 sum = (ip->saddr & 0xffff) + (ip->saddr >> 16) + (ip->daddr & 0xffff) +
		    (ip->daddr >> 16) + bpf_htons((__u16)ip->protocol) + bpf_htons((__u16)l4_len);
	int udp = ip->protocol == IPPROTO_UDP;
	*csum = 0;
	__u32 off = sizeof(struct ethhdr) + sizeof(struct iphdr);
	for (__u32 i = 0; i < CSUM_CHUNKS; i++) {
		__u32 done = i * 64;
		if (done >= l4_len)
			break;
		__u64 n = (__u64)l4_len - done;
		__u8 buf[64];
		if (n >= 64) {
			if (bpf_xdp_load_bytes(ctx, off + done, buf, 64))
				return -1;
		} else {
			__builtin_memset(buf, 0, sizeof(buf));
			// Bounds the verifier can see (1..63): clang may otherwise keep `n` in a
			// form whose range it loses.
			asm volatile("%0 &= 63" : "+r"(n));
			if (n == 0 || bpf_xdp_load_bytes(ctx, off + done, buf, n))
				return -1;
		}
		sum = (__u32)bpf_csum_diff(0, 0, (void *)buf, sizeof(buf), sum);
	}
	__u16 v = (__u16)~fold_all(sum);
	if (udp && v == 0)
		v = 0xffff;
	*csum = v;
	return 0;
}

// Applies a plan: MACs, TTL, the destination (forward) or source (reply) address and
// port, checksums (as `Engine::forward_fast` / `reverse_fast` write them), expiry,
// counters; redirects to the egress.
static __always_inline int fast_apply(struct xdp_md *ctx, struct iphdr *ip, void *end,
				      struct fast_plan *p)
{
	struct ethhdr *eth = (void *)(long)ctx->data;
	__be16 *ports = (void *)(ip + 1);
	__u16 *csum;
	if ((void *)(eth + 1) > end || (void *)(ports + 4) > end)
		return XDP_PASS;
	if (ip->protocol == IPPROTO_TCP) {
		csum = (void *)((__u8 *)ports + 16);
		if ((void *)(csum + 1) > end)
			return XDP_PASS;
	} else {
		csum = (void *)((__u8 *)ports + 6);
	}
	__builtin_memcpy(eth->h_dest, p->macs, 6);
	__builtin_memcpy(eth->h_source, p->macs + 6, 6);
	__be32 *addr = p->reply ? &ip->saddr : &ip->daddr;
	__be16 *port = p->reply ? &ports[0] : &ports[1];
	__u16 a = addr_delta(*addr, p->new_addr);
	__u16 l4d = delta_add(a, word_delta(*port, p->new_port));
	ip->check = csum_apply(ip->check, delta_add(a, ttl_delta()));
	ip->ttl -= 1;
	*addr = p->new_addr;
	*port = p->new_port;
	if (p->complete) {
		if (complete_l4(ctx, ip, csum, p->l4_len))
			return XDP_DROP;
	} else if (ip->protocol == IPPROTO_TCP) {
		*csum = csum_apply(*csum, l4d);
	} else if (*csum != 0) {
		// `~(~old + delta)` with 0 sent as 0xffff, as `l4_csum_update` writes it.
		*csum = fold_once((__u32)*csum + (__u16)~l4d);
	}
	// Push the expiry out only when it moves by a second or more: the record's cache
	// line stays clean for most packets (an expiry up to 1 s early is harmless).
	if ((__s32)(p->expires - *(volatile __u32 *)&p->flow->expires) >= 1000)
		*(volatile __u32 *)&p->flow->expires = p->expires;
	__u64 bytes = (__u64)((long)ctx->data_end - (long)ctx->data);
	__sync_fetch_and_add(p->reply ? &p->slot->traffic_out : &p->slot->traffic_in,
			     TRAFFIC_PACKET | bytes);
	return bpf_redirect(p->ifindex, 0);
}

// What the fast part of a packet's handling returns when the rest must decide: the
// interface's AF_XDP socket (`ifaces`) is only looked up then.
#define SLOW_PATH -1

// What the uplink's fast part learnt of the packet's flow, for the rest (`uplink`).
#define FLOW_UNKNOWN 0 // not looked up (yet), not a whole TCP/UDP packet, or not certain
#define FLOW_NONE 1    // certain: no table holds it
#define FLOW_HELD 2    // a table holds it

// Looks an uplink packet's flow up (a whole TCP/UDP packet): FLOW_HELD with `c` filled
// in, FLOW_NONE when certain that no table holds it (a table is published and none
// does), FLOW_UNKNOWN otherwise.
static __always_inline int look_up_uplink(struct iphdr *ip, void *end, struct probe_ctx *c)
{
	__be16 *ports = (void *)(ip + 1);
	int l4 = ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP;
	if (!l4 || ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)) || (void *)(ports + 2) > end)
		return FLOW_UNKNOWN;
	find_flow(c, ip->saddr, ip->daddr, ports[0], ports[1], ip->protocol, 0);
	if (c->result == FIND_HIT)
		return FLOW_HELD;
	return c->result == FIND_MISS && c->workers != 0 ? FLOW_NONE : FLOW_UNKNOWN;
}

// `flow` as the fast part found it, looked up now if it did not (FLOW_UNKNOWN): for the
// slow part's rare cases (a limited prefix, a denied client, a port no longer exposed),
// the look-up is paid only there.
static __always_inline int known_flow(struct iphdr *ip, void *end, int flow)
{
	if (flow != FLOW_UNKNOWN)
		return flow;
	struct probe_ctx c = {};
	return look_up_uplink(ip, end, &c);
}

// Whether the XDP fast path is published (table 0's part: its sequence word even and not
// 0; off unless opted in, and odd while off or rewritten): only then is every uplink
// packet's flow looked up first. Without it the look-up is left to userspace, which
// hashes a whole batch and overlaps its cache misses.
static __always_inline int fast_path_published(void)
{
	__u32 zero = 0;
	struct fast_head *head = bpf_map_lookup_elem(&fast_slots, &zero);
	if (!head)
		return 0;
	__u32 seq = *(volatile __u32 *)&head->seq;
	return seq != 0 && !(seq & 1);
}

// The uplink's fast part: a whole TCP/UDP packet of an established flow, which the fast
// path forwards without the `frontends` look-up (a record checked against the table the
// fast path was published for implies its VIP:port is exposed). SLOW_PATH otherwise,
// with what the look-up found in `flow` (FLOW_*; FLOW_UNKNOWN without the fast path).
static __always_inline int uplink_fast(struct xdp_md *ctx, struct iphdr *ip, void *end,
				       int *flow)
{
	if (!fast_path_published())
		return SLOW_PATH;
	struct probe_ctx c = {};
	*flow = look_up_uplink(ip, end, &c);
	if (*flow == FLOW_HELD) {
		struct fast_plan p = {};
		if (fast_plan(ip, end, &c, &p) == 0)
			return fast_apply(ctx, ip, end, &p);
	}
	return SLOW_PATH;
}

// The `admit_open` slot of a source prefix key (`admission::slot`).
static __always_inline __u32 admit_slot(__u32 key, __u64 seed)
{
	__u32 h = (key ^ (__u32)seed) * 0x9e3779b1U;
	h ^= h >> 16;
	h *= (__u32)(seed >> 32) | 1;
	return (h >> 16) & (ADMIT_SLOTS - 1);
}

// Whether a packet of no flow from the source prefix key `key` would be admitted now:
// its slot's next admission is due (or the admission is off). Reads only; userspace
// debits the bucket when the packet reaches it.
static __always_inline int admit_open_now(__u32 key)
{
	__u32 zero = 0;
	struct admit_conf *conf = bpf_map_lookup_elem(&admit_conf, &zero);
	if (!conf || conf->rate == 0)
		return 1;
	__u32 slot = admit_slot(key, conf->seed);
	__u64 *open = bpf_map_lookup_elem(&admit_open, &slot);
	if (!open)
		return 1;
	__u64 tat = *(volatile __u64 *)open;
	__u64 at = tat > conf->tolerance_ns ? tat - conf->tolerance_ns : 0;
	// The coarse clock is at most a tick behind: when it says "due", it is.
	if (bpf_ktime_get_coarse_ns() >= at)
		return 1;
	return bpf_ktime_get_ns() >= at;
}

// The admission key of an IPv4 source: its /24 as the packet holds it.
static __always_inline __u32 admit_key(__be32 saddr)
{
	return saddr & bpf_htonl(0xffffff00);
}

// Whether one of the frontend's source ranges holds `saddr` (a frontend with
// FRONTEND_FILTERED; userspace adds its ranges before it sets the bit).
static __always_inline int source_admitted(struct frontend_key *frontend, __be32 saddr)
{
	struct source_range_key k = { .prefixlen = 96, .frontend = *frontend, .saddr = saddr };
	return bpf_map_lookup_elem(&source_ranges, &k) != 0;
}

// The uplink's slow part, `slot` the AF_XDP socket of the packet's queue: a packet of a
// flow the fast part found held goes to userspace without the `frontends` look-up
// (userspace re-validates every flow against the table in force: a Service removed since
// is its drop, named); any other packet to an exposed VIP:port too — one of no flow only
// within the new-flow admission (`admit_open_now`). `flow` is FLOW_UNKNOWN without the
// fast path: the flow is then looked up only where the answer changes the verdict.
static __always_inline int uplink(struct xdp_md *ctx, struct iphdr *ip, void *end, __u32 slot,
				  int flow)
{
	if (flow == FLOW_HELD)
		return to_userspace(slot);
	__be16 *ports = (void *)(ip + 1);
	struct frontend_key key = { .addr = ip->daddr, .proto = ip->protocol, .pad = 0 };
	int l4 = ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP;
	if (l4 && ip->ihl == 5 && !(ip->frag_off & bpf_htons(0x3fff)) && (void *)(ports + 2) <= end) {
		key.port = ports[1];
		__u8 *exposed = bpf_map_lookup_elem(&frontends, &key);
		if (exposed) {
			// Before the admission: a denied client spends no prefix's tokens. A flow
			// it held (admitted by the ranges before) goes on to userspace, which
			// ends it.
			if ((*exposed & FRONTEND_FILTERED) && !source_admitted(&key, ip->saddr)) {
				flow = known_flow(ip, end, flow);
				if (flow != FLOW_HELD)
					return count_drop(SD_SOURCE_RANGE_DENIED);
				return to_userspace(slot);
			}
			if (*exposed & FRONTEND_HOST_NETWORK)
				return XDP_PASS; // the kernel's DNAT delivers it to a host-network Pod
			if (flow != FLOW_HELD && !admit_open_now(admit_key(ip->saddr))) {
				// The prefix is limited: only now is the flow looked up.
				flow = known_flow(ip, end, flow);
				if (flow == FLOW_NONE)
					return count_drop(SD_NEW_FLOW_PREFIX_RATE);
			}
			return to_userspace(slot);
		}
	}
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
		if (!bpf_map_lookup_elem(&redirect_from, &ip->saddr))
			return count_drop(SD_REDIRECT_NOT_FROM_PEER);
		return to_userspace(slot);
	}
	if (ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)))
		return to_userspace(slot); // counted by userspace
	if (l4) {
		if ((void *)(ports + 2) > end)
			return to_userspace(slot); // malformed: counted
		// A held flow of a port no longer exposed: userspace ends it.
		flow = known_flow(ip, end, flow);
		if (flow == FLOW_HELD)
			return to_userspace(slot);
		return count_drop(SD_PORT_NOT_EXPOSED); // (an exposed port was found above)
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
	return to_userspace(slot);
}

// A Pod interface's fast part: a TCP/UDP packet that is no flow's reply passes; a
// reply of an established flow is fast-pathed; SLOW_PATH for the rest (replies userspace
// handles, ICMP).
static __always_inline int pod_fast(struct xdp_md *ctx, struct iphdr *ip, void *end)
{
	if (ip->frag_off & bpf_htons(0x1fff)) {
		// A later fragment: no ports to match; it follows its first fragment.
		struct frag_key fk = frag_key_of(ip);
		return bpf_map_lookup_elem(&frag_replies, &fk) ? SLOW_PATH : XDP_PASS;
	}
	__u32 ihl = (ip->ihl & 0xf) * 4;
	if (ihl < sizeof(*ip))
		return XDP_PASS;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return SLOW_PATH;
	__be16 *ports = (void *)((__u8 *)ip + ihl);
	if ((void *)(ports + 2) > end)
		return XDP_PASS;
	struct probe_ctx c = {};
	find_flow(&c, ip->saddr, ip->daddr, ports[0], ports[1], ip->protocol, 1);
	if (c.result == FIND_MISS)
		return XDP_PASS;
	// First fragments and packets with options of a flow go too: userspace NATs a first
	// fragment (its later ones follow, see `frag_replies`) and drops options rather than
	// let the kernel route them un-NATed.
	if (ip->frag_off & bpf_htons(0x2000)) {
		struct frag_key fk = frag_key_of(ip);
		__u8 one = 1;
		bpf_map_update_elem(&frag_replies, &fk, &one, BPF_ANY);
	}
	if (ihl != sizeof(*ip) || (ip->frag_off & bpf_htons(0x3fff)))
		return SLOW_PATH;
	if (c.result == FIND_HIT) {
		struct fast_plan p = {};
		if (fast_plan(ip, end, &c, &p) == 0)
			return fast_apply(ctx, ip, end, &p);
	}
	return SLOW_PATH;
}

// A Pod interface's slow part (after `pod_fast`): a TCP/UDP reply goes to userspace;
// an ICMP error about a packet of a flow too.
static __always_inline int pod(struct xdp_md *ctx, struct iphdr *ip, void *end, __u32 slot)
{
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP)
		return to_userspace(slot);
	if (ip->protocol != IPPROTO_ICMP || ip->ihl != 5)
		return XDP_PASS;
	// An ICMP error a backend sends about a packet of a flow (client -> backend): the
	// quoted packet reversed is the flow's reverse key.
	__u8 *l4 = (void *)(ip + 1);
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
	return to_userspace(slot);
}

// Whether the packet arrived on an uplink (`uplinks`; ifindexes are never 0).
static __always_inline int is_uplink(__u32 ifindex)
{
	__u32 zero = 0;
	struct uplink_set *u = bpf_map_lookup_elem(&uplinks, &zero);
	if (!u)
		return 0;
	for (int i = 0; i < MAX_UPLINKS; i++)
		if (u->ifindex[i] == ifindex)
			return 1;
	return 0;
}

// The configuration of the interface the packet arrived on: an uplink's from `uplinks`
// (an array read inline; looked up again rather than kept from `is_uplink`, which would
// carry a map pointer through every path the verifier walks), a Pod interface's from the
// `ifaces` hash. NULL for an interface of neither.
static __always_inline struct iface_conf *iface_conf_of(__u32 ifindex, int up)
{
	if (!up)
		return bpf_map_lookup_elem(&ifaces, &ifindex);
	__u32 zero = 0;
	struct uplink_set *u = bpf_map_lookup_elem(&uplinks, &zero);
	if (!u)
		return NULL;
	for (int i = 0; i < MAX_UPLINKS; i++)
		if (u->ifindex[i] == ifindex)
			return &u->conf[i];
	return NULL;
}

// The AF_XDP socket (`xsks` index) of the packet's RX queue on an interface; none
// (0xffffffff: what is ours is dropped) for a queue without one.
static __always_inline __u32 socket_slot(struct xdp_md *ctx, struct iface_conf *conf)
{
	__u32 queue = ctx->rx_queue_index;
	if (queue >= conf->queues)
		return 0xffffffff;
	return conf->slot_base + queue;
}

// ---- IPv6 (issue #28) ----

#define NH_FRAGMENT 44
#define NH_ICMPV6 58
#define ICMP6_ND_FIRST 133 // router solicitation .. redirect: neighbour discovery
#define ICMP6_ND_LAST 137

// What an IPv6 rule returns for a packet that goes to the interface's AF_XDP socket
// (looked up only then).
#define TO_SOCKET6 -3

// Destination unreachable, packet too big, time exceeded: the errors that quote a packet
// of a flow.
static __always_inline int icmp6_error(__u8 type)
{
	return type >= 1 && type <= 3;
}

// Whether userspace holds an IPv6 flow with this key (as the packet holds it).
static __always_inline int held6(const void *src, const void *dst, __be16 sport,
				 __be16 dport, __u8 proto)
{
	struct flow6_key k = {};
	__builtin_memcpy(k.src, src, 16);
	__builtin_memcpy(k.dst, dst, 16);
	k.sport = sport;
	k.dport = dport;
	k.proto = proto;
	return bpf_map_lookup_elem(&flows6, &k) != 0;
}

// Whether `addr:port/proto` is an exposed IPv6 frontend.
static __always_inline int exposed6(const void *addr, __be16 port, __u8 proto)
{
	struct frontend6_key f = {};
	__builtin_memcpy(f.addr, addr, 16);
	f.port = port;
	f.proto = proto;
	return bpf_map_lookup_elem(&frontends6, &f) != 0;
}

// The new-flow admission of an IPv6 source: per /64 (a site's or subscriber's usual
// prefix), its admission key a hash of the /64 whose last byte is never 0, so that
// it never shares an IPv4 /24's bucket (whose key ends in 0).
static __always_inline __u32 admit_key6(const void *saddr)
{
	__u64 hi;
	__builtin_memcpy(&hi, saddr, 8);
	__u64 h = hi * 0x9e3779b97f4a7c15ULL;
	return (__u32)(h >> 32) | bpf_htonl(1);
}

// An ICMPv6 message to a VIP on the uplink: an error quoting a packet from an exposed
// VIP:port goes to userspace; anything else is dropped here.
static __always_inline int uplink_icmp6(__u8 *icmp, void *end)
{
	struct ipv6hdr *q = (void *)(icmp + 8);
	if ((void *)(q + 1) + 4 > end || !icmp6_error(icmp[0]))
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	if (q->nexthdr != IPPROTO_TCP && q->nexthdr != IPPROTO_UDP)
		return count_drop(SD_UNSUPPORTED_PROTOCOL);
	__be16 *qports = (void *)(q + 1);
	if (!exposed6(&q->saddr, qports[0], q->nexthdr))
		return count_drop(SD_PORT_NOT_EXPOSED);
	return TO_SOCKET6;
}

// The uplink's IPv6 rules: TCP/UDP of a held flow, or of no flow to an exposed VIP:port
// (within the new-flow admission), goes to userspace; other TCP/UDP to a VIP is dropped;
// ICMPv6 to a VIP as `uplink_icmp6`; any other next header to a VIP (extension headers)
// goes to userspace, which walks them and counts what it does not forward.
static __always_inline int uplink6(struct ipv6hdr *ip6, void *end)
{
	__u8 nh = ip6->nexthdr;
	__u8 *l4 = (void *)(ip6 + 1);
	if (nh == IPPROTO_TCP || nh == IPPROTO_UDP) {
		__be16 *ports = (void *)l4;
		if ((void *)(ports + 2) <= end) {
			if (held6(&ip6->saddr, &ip6->daddr, ports[0], ports[1], nh))
				return TO_SOCKET6;
			if (exposed6(&ip6->daddr, ports[1], nh)) {
				if (!admit_open_now(admit_key6(&ip6->saddr)))
					return count_drop(SD_NEW_FLOW_PREFIX_RATE);
				return TO_SOCKET6;
			}
			if (bpf_map_lookup_elem(&vips6, &ip6->daddr))
				return count_drop(SD_PORT_NOT_EXPOSED);
			return XDP_PASS;
		}
	}
	if (!bpf_map_lookup_elem(&vips6, &ip6->daddr))
		return XDP_PASS;
	if (nh != NH_ICMPV6 || (void *)(l4 + 8) > end)
		return TO_SOCKET6; // counted by userspace if it cannot forward it
	return uplink_icmp6(l4, end);
}

// A Pod interface's IPv6 packet with a Fragment header first: the first fragment of a
// held flow's reply goes to userspace and is remembered (`frag6_replies`) if more
// follow; a later fragment goes if its datagram was remembered.
static __always_inline int pod_frag6(struct ipv6hdr *ip6, __u8 *fh, void *end)
{
	if ((void *)(fh + 8) > end)
		return XDP_PASS;
	struct frag6_key fk = {};
	__builtin_memcpy(fk.src, &ip6->saddr, 16);
	__builtin_memcpy(fk.dst, &ip6->daddr, 16);
	__builtin_memcpy(&fk.id, fh + 4, 4);
	__u16 offset_flags = bpf_ntohs(*(__be16 *)(fh + 2));
	if (offset_flags >> 3)
		return bpf_map_lookup_elem(&frag6_replies, &fk) ? TO_SOCKET6 : XDP_PASS;
	__u8 nh = fh[0];
	__be16 *ports = (void *)(fh + 8);
	if ((nh != IPPROTO_TCP && nh != IPPROTO_UDP) || (void *)(ports + 2) > end)
		return XDP_PASS;
	if (!held6(&ip6->saddr, &ip6->daddr, ports[0], ports[1], nh))
		return XDP_PASS;
	if (offset_flags & 1) {
		__u8 one = 1;
		bpf_map_update_elem(&frag6_replies, &fk, &one, BPF_ANY);
	}
	return TO_SOCKET6;
}

// A Pod interface's IPv6 rules: a held flow's reply (TCP/UDP directly, or fragmented as
// `pod_frag6`), and an ICMPv6 error about a packet of a held flow (client -> backend:
// the quoted packet reversed is the flow's reverse key), go to userspace; the rest is
// the Pod's own traffic.
static __always_inline int pod6(struct ipv6hdr *ip6, void *end)
{
	__u8 nh = ip6->nexthdr;
	__u8 *l4 = (void *)(ip6 + 1);
	if (nh == IPPROTO_TCP || nh == IPPROTO_UDP) {
		__be16 *ports = (void *)l4;
		if ((void *)(ports + 2) > end)
			return XDP_PASS;
		return held6(&ip6->saddr, &ip6->daddr, ports[0], ports[1], nh) ? TO_SOCKET6
									      : XDP_PASS;
	}
	if (nh == NH_FRAGMENT)
		return pod_frag6(ip6, l4, end);
	struct ipv6hdr *q = (void *)(l4 + 8);
	if (nh != NH_ICMPV6 || (void *)(q + 1) + 4 > end || !icmp6_error(l4[0]))
		return XDP_PASS;
	if (q->nexthdr != IPPROTO_TCP && q->nexthdr != IPPROTO_UDP)
		return XDP_PASS;
	__be16 *qports = (void *)(q + 1);
	return held6(&q->daddr, &q->saddr, qports[1], qports[0], q->nexthdr) ? TO_SOCKET6
										 : XDP_PASS;
}

// An IPv6 packet (never fast-pathed). A subprogram of its own: the verifier walks it
// once, apart from the IPv4 paths.
static __noinline int steer6(struct xdp_md *ctx)
{
	void *end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip6 = (void *)(long)ctx->data + sizeof(struct ethhdr);
	if ((void *)(ip6 + 1) > end)
		return XDP_PASS;
	if (ip6->hop_limit <= 1)
		return XDP_PASS; // the kernel answers with ICMPv6 time exceeded
	__u8 *l4 = (void *)(ip6 + 1);
	if (ip6->nexthdr == NH_ICMPV6 && (void *)(l4 + 1) <= end && l4[0] >= ICMP6_ND_FIRST &&
	    l4[0] <= ICMP6_ND_LAST)
		return XDP_PASS; // neighbour discovery is the kernel's, on every interface
	int up = is_uplink(ctx->ingress_ifindex);
	int r = up ? uplink6(ip6, end) : pod6(ip6, end);
	if (r != TO_SOCKET6)
		return r;
	struct iface_conf *conf = iface_conf_of(ctx->ingress_ifindex, up);
	if (!conf)
		return XDP_PASS;
	return to_userspace(socket_slot(ctx, conf));
}

SEC("xdp.frags")
int juneau_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return eth->h_proto == bpf_htons(ETH_P_IPV6) ? steer6(ctx) : XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return XDP_PASS;
	if (ip->ttl <= 1)
		return XDP_PASS; // the kernel answers with ICMP time exceeded
	// Every other interface the program is attached to is a Pod's (or one being
	// attached or detached, which has no `ifaces` entry: it passes what it does not
	// fast-path).
	int up = is_uplink(ctx->ingress_ifindex);
	int flow = FLOW_UNKNOWN;
	int r = up ? uplink_fast(ctx, ip, end, &flow) : pod_fast(ctx, ip, end);
	if (r != SLOW_PATH)
		return r;
	struct iface_conf *conf = iface_conf_of(ctx->ingress_ifindex, up);
	if (!conf)
		return XDP_PASS;
	__u32 slot = socket_slot(ctx, conf);
	if (up)
		return uplink(ctx, ip, end, slot, flow);
	return pod(ctx, ip, end, slot);
}

// No GPL-only helper is used, so the project licence is stated as is.
char LICENSE[] SEC("license") = "Apache-2.0";
