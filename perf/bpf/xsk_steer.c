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
PORT_MAP(STEER_PORT);

SEC("xdp")
int xsk_steer(struct xdp_md *ctx)
{
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    if (parse_udp4_to(ctx, &STEER_PORT, &eth, &ip, &udp) < 0)
        return XDP_PASS;
    return bpf_redirect_map(&XSKS, ctx->rx_queue_index, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
