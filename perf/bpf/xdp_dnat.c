/* The in-kernel XDP DNAT baseline, the Katran/Cilium approach in miniature:
 *  - `xdp_dnat_in` on the node's client-facing interface: UDP to a service (VIP, port) is
 *    pinned to a backend through an LRU flow table (new flows pick from the service's
 *    backend ring by a flow hash), DNATed with incremental checksums, its MACs rewritten,
 *    and XDP_REDIRECTed to the backend-facing interface.
 *  - `xdp_dnat_out` on the backend-facing interface: replies from a backend are reverse
 *    NATed to the VIP and redirected to the client-facing interface.
 * Anything else passes to the kernel. No SNAT, like Juneau. */
#include "common.h"

#define RING_SIZE 64

struct svc_key {
    __u32 vip;   /* network order */
    __u16 port;  /* network order */
    __u16 pad;
};

struct svc_val {
    __u32 ring_id;  /* index into RINGS */
};

struct backend {
    __u32 ip;       /* network order */
    __u16 port;     /* network order */
    __u16 pad;
};

struct flow_key {
    __u32 src;
    __u32 dst;
    __u16 sport;
    __u16 dport;
};

struct rev_key {
    __u32 ip;
    __u16 port;
    __u16 pad;
};

struct rev_val {
    __u32 vip;
    __u16 port;
    __u16 pad;
};

/* Interface and neighbour configuration, index 0. */
struct link_cfg {
    __u32 client_ifindex;   /* node's client-facing interface */
    __u32 backend_ifindex;  /* node's backend-facing interface */
    __u8 node_client_mac[6];
    __u8 client_mac[6];
    __u8 node_backend_mac[6];
    __u8 backend_mac[6];
};

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, struct svc_key);
    __type(value, struct svc_val);
} SERVICES SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1024 * RING_SIZE);
    __type(key, __u32);
    __type(value, struct backend);
} RINGS SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 2 * 1024 * 1024);
    __type(key, struct flow_key);
    __type(value, struct backend);
} FLOWS SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, struct rev_key);
    __type(value, struct rev_val);
} REVERSE SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct link_cfg);
} LINKS SEC(".maps");

static __always_inline __u32 flow_hash(struct flow_key *k)
{
    __u32 h = k->src * 0x9e3779b1u;
    h ^= (((__u32)k->sport << 16) | k->dport) * 0x85ebca6bu;
    h ^= k->dst * 0xc2b2ae35u;
    h ^= h >> 15;
    return h;
}

SEC("xdp")
int xdp_dnat_in(struct xdp_md *ctx)
{
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    if (parse_udp4(ctx, &eth, &ip, &udp) < 0)
        return XDP_PASS;
    struct svc_key sk = {.vip = ip->daddr, .port = udp->dest};
    struct svc_val *svc = bpf_map_lookup_elem(&SERVICES, &sk);
    if (!svc)
        return XDP_PASS;
    __u32 zero = 0;
    struct link_cfg *cfg = bpf_map_lookup_elem(&LINKS, &zero);
    if (!cfg)
        return XDP_PASS;

    struct flow_key fk = {.src = ip->saddr, .dst = ip->daddr, .sport = udp->source, .dport = udp->dest};
    struct backend *be = bpf_map_lookup_elem(&FLOWS, &fk);
    if (!be) {
        __u32 slot = svc->ring_id * RING_SIZE + (flow_hash(&fk) % RING_SIZE);
        be = bpf_map_lookup_elem(&RINGS, &slot);
        if (!be || be->ip == 0)
            return XDP_DROP;
        bpf_map_update_elem(&FLOWS, &fk, be, BPF_ANY);
    }
    if (ip->ttl <= 1)
        return XDP_PASS;

    nat_udp4(ip, udp, 1, be->ip, be->port);

    __builtin_memcpy(eth->h_source, cfg->node_backend_mac, 6);
    __builtin_memcpy(eth->h_dest, cfg->backend_mac, 6);
    return bpf_redirect(cfg->backend_ifindex, 0);
}

SEC("xdp")
int xdp_dnat_out(struct xdp_md *ctx)
{
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    if (parse_udp4(ctx, &eth, &ip, &udp) < 0)
        return XDP_PASS;
    struct rev_key rk = {.ip = ip->saddr, .port = udp->source};
    struct rev_val *rv = bpf_map_lookup_elem(&REVERSE, &rk);
    if (!rv)
        return XDP_PASS;
    __u32 zero = 0;
    struct link_cfg *cfg = bpf_map_lookup_elem(&LINKS, &zero);
    if (!cfg || ip->ttl <= 1)
        return XDP_PASS;

    nat_udp4(ip, udp, 0, rv->vip, rv->port);

    __builtin_memcpy(eth->h_source, cfg->node_client_mac, 6);
    __builtin_memcpy(eth->h_dest, cfg->client_mac, 6);
    return bpf_redirect(cfg->client_ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
