/* Steering for the raw AF_XDP forwarder baseline: UDP to the configured port goes to the
 * AF_XDP socket of the receive queue; everything else passes to the kernel. */
#include "common.h"

struct {
    __uint(type, BPF_MAP_TYPE_XSKMAP);
    __uint(max_entries, 4);
    __type(key, __u32);
    __type(value, __u32);
} XSKS SEC(".maps");

/* Index 0: the UDP destination port to steer, network byte order. */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u32);
} STEER_PORT SEC(".maps");

SEC("xdp")
int xsk_steer(struct xdp_md *ctx)
{
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    if (parse_udp4(ctx, &eth, &ip, &udp) < 0)
        return XDP_PASS;
    __u32 zero = 0;
    __u32 *port = bpf_map_lookup_elem(&STEER_PORT, &zero);
    if (!port || udp->dest != (__u16)*port)
        return XDP_PASS;
    return bpf_redirect_map(&XSKS, ctx->rx_queue_index, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
