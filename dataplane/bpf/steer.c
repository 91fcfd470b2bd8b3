// SPDX-License-Identifier: Apache-2.0
// Juneau's XDP steering program.
//
// Attached to the uplink and to every Pod-facing interface. It redirects to the
// interface's AF_XDP socket only what the userspace dataplane must see:
//   - on the uplink: IPv4 packets whose destination is a VIP (map `vips`);
//   - on a Pod interface: IPv4 TCP/UDP packets whose source ip:port/proto is a backend
//     (map `backends`); ICMP errors quoting a packet to a backend (so they can be
//     reverse-NATed); and fragments / packets with IP options from a backend address
//     (map `backend_ips`), which userspace drops and counts rather than let the kernel
//     forward them un-NATed.
// Everything else -- ARP, IPv6, ICMP to the node, BGP, SSH, Pods' own traffic -- and any
// packet whose TTL would expire returns XDP_PASS and goes to the kernel untouched.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ROLE_UPLINK 0
#define ROLE_POD 1

struct iface_conf {
	__u32 slot_base; // xsks index of the socket on RX queue 0 of this interface
	__u32 queues;    // sockets (RX queues) of this interface: slot_base + queue
	__u32 role;      // ROLE_*
};

struct backend_key {
	__u32 addr; // network order
	__u16 port; // network order
	__u8 proto;
	__u8 pad;
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
	__type(key, struct backend_key);
	__type(value, __u8);
} backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); // backend address, network order
	__type(value, __u8);
} backend_ips SEC(".maps");

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
	if (queue >= conf->queues)
		return XDP_PASS; // no socket on this queue
	__u32 slot = conf->slot_base + queue;
	if (conf->role == ROLE_UPLINK) {
		if (!bpf_map_lookup_elem(&vips, &ip->daddr))
			return XDP_PASS;
		return bpf_redirect_map(&xsks, slot, XDP_PASS);
	}
	// Pod-facing interface: only replies from backend ports.
	int odd = ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff));
	if (odd) {
		if (bpf_map_lookup_elem(&backend_ips, &ip->saddr))
			return bpf_redirect_map(&xsks, slot, XDP_PASS);
		return XDP_PASS;
	}
	if (ip->protocol == IPPROTO_ICMP) {
		// An ICMP error (unreachable, time exceeded) a backend sends about a packet
		// that came through the VIP: the quoted packet's destination is a backend.
		__u8 *icmp = (void *)(ip + 1);
		struct iphdr *q = (void *)(icmp + 8);
		if ((void *)(q + 1) + 4 > end)
			return XDP_PASS;
		if ((icmp[0] != 3 && icmp[0] != 11) || q->ihl != 5)
			return XDP_PASS;
		if (q->protocol != IPPROTO_TCP && q->protocol != IPPROTO_UDP)
			return XDP_PASS;
		__be16 *qports = (void *)(q + 1);
		struct backend_key qkey = {
			.addr = q->daddr,
			.port = qports[1],
			.proto = q->protocol,
			.pad = 0,
		};
		if (!bpf_map_lookup_elem(&backends, &qkey))
			return XDP_PASS;
		return bpf_redirect_map(&xsks, slot, XDP_PASS);
	}
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return XDP_PASS;
	__be16 *ports = (void *)(ip + 1);
	if ((void *)(ports + 2) > end)
		return XDP_PASS;
	struct backend_key key = {
		.addr = ip->saddr,
		.port = ports[0],
		.proto = ip->protocol,
		.pad = 0,
	};
	if (!bpf_map_lookup_elem(&backends, &key))
		return XDP_PASS;
	return bpf_redirect_map(&xsks, slot, XDP_PASS);
}

// No GPL-only helper is used, so the project licence is stated as is.
char LICENSE[] SEC("license") = "Apache-2.0";
