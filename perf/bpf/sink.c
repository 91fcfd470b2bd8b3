/* The backend's sink: counts benchmark UDP packets (to one port) in a per-CPU counter and
 * drops them; everything else (ARP, the latency echo port) passes to the kernel.
 * Also `xdp_pass`, attached to veth ends that must accept XDP_REDIRECTed frames. */
#include "common.h"

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u64);
} SINK_COUNT SEC(".maps");

/* Index 0: the UDP destination port to count and drop, in network byte order. */
PORT_MAP(SINK_PORT);

SEC("xdp")
int xdp_sink(struct xdp_md *ctx)
{
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    if (parse_udp4_to(ctx, &SINK_PORT, &eth, &ip, &udp) < 0)
        return XDP_PASS;
    __u32 zero = 0;
    __u64 *count = bpf_map_lookup_elem(&SINK_COUNT, &zero);
    if (count)
        *count += 1;
    return XDP_DROP;
}

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
    return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
