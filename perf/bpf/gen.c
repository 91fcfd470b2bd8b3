/* The live-frames traffic generator: run with BPF_PROG_RUN and BPF_F_TEST_XDP_LIVE_FRAMES
 * (perf/src/livegen.rs), the kernel runs this program on every frame made from one 64-byte
 * UDP template and transmits what it redirects. Each frame gets the next flow's source
 * address and port (the same mapping as `packet::flow`: 64 source ports per address), so
 * the flow count is exact (GEN_IPV6: the same over IPv6, 70-byte frames); the IPv4 header
 * checksum is recomputed, the UDP checksum set
 * to 0 ("none", valid for UDP over IPv4) or, with GEN_PARTIAL_CSUM, to a partial checksum.
 * With GEN_REPLY the flow is the destination (replies of a backend to the flows' clients).
 * Frame contents persist across page recycling
 * in live-frames mode, and a kernel path forwards a frame in place (the node's ip_forward
 * decrements the TTL and writes the next hop's MACs, a DNAT rewrites the destination, all
 * in the page the generator sent): so the whole header (GEN_HDR_LEN bytes, the template
 * in the config) is written on every frame, then the fields that vary. With a rate,
 * frames not yet due are dropped before they are sent (token clock in GEN_SEQ[1]). */
#include "common.h"
#include <linux/ipv6.h>
#include <linux/tcp.h>

/* flags */
#define GEN_REPLY 1        /* the flow is the destination, peer_ip:peer_port the source */
#define GEN_PARTIAL_CSUM 2 /* UDP checksum = folded pseudo-header sum (CHECKSUM_PARTIAL, as
                              a Pod's kernel with tx offload hands it over), not 0 */
#define GEN_TCP 4          /* the template is Ethernet + IPv4 + TCP (GEN_TCP_HDR_LEN bytes, the
                              flags as the template has them): the sequence number is the
                              frame's number, the TCP checksum recomputed */
#define GEN_FIRST_FRAGMENT 8 /* a first fragment: more-fragments set, offset 0, the IP id
                                the frame's number */
#define GEN_IPV6 16        /* the template is Ethernet + IPv6 + UDP (GEN_HDR6_LEN bytes) with
                              GEN_PAYLOAD6_LEN bytes of payload after it: the flow's address
                              goes into the last 32 bits of the source address, the UDP
                              checksum (mandatory over IPv6) is recomputed; alone, no other
                              flag */

struct gen_cfg {
    __u32 ifindex;   /* where to redirect (the client's veth, in the caller's netns) */
    __u32 flows;     /* number of flows, sent round robin (>= 1) */
    __u32 src_base;  /* first flow address, host byte order */
    __u32 flags;     /* GEN_* */
    __u64 gap_ns;    /* pacing: at most one frame per gap_ns (0: no pacing) */
    __u32 peer_ip;   /* GEN_REPLY: the fixed source address, network byte order */
    __u16 peer_port; /* GEN_REPLY: the fixed source port, network byte order */
    __u16 pad;
    __u64 max_sent;  /* send no more than this many frames in all (0: no bound) */
    __u8 hdr[64];    /* the template's headers (GEN_HDR_LEN bytes, GEN_TCP_HDR_LEN with GEN_TCP,
                        GEN_HDR6_LEN with GEN_IPV6) */
};

/* Ethernet (14) + IPv4 without options (20) + UDP (8). */
#define GEN_HDR_LEN 42
/* Ethernet (14) + IPv4 without options (20) + TCP without options (20). */
#define GEN_TCP_HDR_LEN 54
/* Ethernet (14) + IPv6 (40) + UDP (8), and the payload after it (packet::FRAME6_LEN). */
#define GEN_HDR6_LEN 62
#define GEN_PAYLOAD6_LEN 8

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct gen_cfg);
} GEN_CFG SEC(".maps");

/* One IPv6 frame (GEN_IPV6): the template's header, then the flow's source address and
 * port, then the UDP checksum over the pseudo-header, the UDP header and the payload. */
static __always_inline int gen_ipv6(struct xdp_md *ctx, struct gen_cfg *cfg, __u32 i)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    if (data + GEN_HDR6_LEN + GEN_PAYLOAD6_LEN > end)
        return XDP_ABORTED;
    __builtin_memcpy(data, cfg->hdr, GEN_HDR6_LEN);
    struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
    struct udphdr *udp = (void *)(ip6 + 1);
    ip6->saddr.in6_u.u6_addr32[3] = bpf_htonl(cfg->src_base + (i >> 6));
    udp->source = bpf_htons(10000 + (i & 63));
    udp->check = 0;
    /* Pseudo-header: both addresses, the upper-layer length (= the UDP length, under
     * 64 KiB) and the next header; then the UDP header and payload, 16 bits at a time. */
    __u32 sum = udp->len + bpf_htons(IPPROTO_UDP);
    __u16 *a = (__u16 *)&ip6->saddr;
#pragma unroll
    for (int k = 0; k < 16; k++)
        sum += a[k];
    __u16 *u = (__u16 *)udp;
#pragma unroll
    for (int k = 0; k < (8 + GEN_PAYLOAD6_LEN) / 2; k++)
        sum += u[k];
    __u16 c = csum_fold32(sum);
    udp->check = c ? c : 0xffff;
    return bpf_redirect(cfg->ifindex, 0);
}

/* Index 0: frames sent (redirected) so far; index 1: the pacing clock (time the next
 * frame is due). The generator is pinned to one CPU; per-CPU needs no atomics. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, __u64);
} GEN_SEQ SEC(".maps");

SEC("xdp")
int xdp_gen(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    if (data + GEN_TCP_HDR_LEN > end)
        return XDP_ABORTED;
    __u32 zero = 0, one = 1;
    struct gen_cfg *cfg = bpf_map_lookup_elem(&GEN_CFG, &zero);
    __u64 *seq = bpf_map_lookup_elem(&GEN_SEQ, &zero);
    __u64 *due = bpf_map_lookup_elem(&GEN_SEQ, &one);
    if (!cfg || !seq || !due || cfg->flows == 0)
        return XDP_ABORTED;
    if (cfg->max_sent && *seq >= cfg->max_sent)
        return XDP_DROP;
    if (cfg->gap_ns) {
        /* Pacing: a frame that is not due yet is dropped here, before it is sent (the
         * kernel's frame loop spins at full speed, the wire sees the paced rate). A
         * clock that fell behind by more than 64 gaps restarts from now (no catch-up
         * burst). */
        __u64 now = bpf_ktime_get_ns();
        if (now < *due)
            return XDP_DROP;
        if (now - *due > 64 * cfg->gap_ns)
            *due = now;
        *due += cfg->gap_ns;
    }
    if (cfg->flags & GEN_IPV6) {
        __u32 i6 = (__u32)(*seq % cfg->flows);
        *seq += 1;
        return gen_ipv6(ctx, cfg, i6);
    }
    /* A recycled page holds what the last path that forwarded it wrote: restore the
     * template's header first. */
    if (cfg->flags & GEN_TCP)
        __builtin_memcpy(data, cfg->hdr, GEN_TCP_HDR_LEN);
    else
        __builtin_memcpy(data, cfg->hdr, GEN_HDR_LEN);
    struct iphdr *ip = data + sizeof(struct ethhdr);
    struct udphdr *udp = (void *)(ip + 1);
    __u32 n = (__u32)*seq;
    __u32 i = (__u32)(*seq % cfg->flows);
    *seq += 1;
    if (cfg->flags & GEN_FIRST_FRAGMENT) {
        ip->id = bpf_htons((__u16)n);
        ip->frag_off = bpf_htons(0x2000);
    }
    __u32 flow_ip = bpf_htonl(cfg->src_base + (i >> 6));
    __u16 flow_port = bpf_htons(10000 + (i & 63));
    if (cfg->flags & GEN_REPLY) {
        ip->saddr = cfg->peer_ip;
        udp->source = cfg->peer_port;
        ip->daddr = flow_ip;
        udp->dest = flow_port;
    } else {
        ip->saddr = flow_ip;
        udp->source = flow_port;
    }
    if (cfg->flags & GEN_TCP) {
        /* The ports sit where UDP's do; the rest is TCP's: a new sequence number and
         * the checksum over the pseudo-header and the 20-byte header. */
        struct tcphdr *tcp = (void *)(ip + 1);
        tcp->seq = bpf_htonl(n);
        tcp->check = 0;
        __u32 t = (ip->saddr & 0xffff) + (ip->saddr >> 16) + (ip->daddr & 0xffff) +
                  (ip->daddr >> 16) + bpf_htons(IPPROTO_TCP) + bpf_htons(20);
        __u16 *tw = (__u16 *)tcp;
#pragma unroll
        for (int k = 0; k < 10; k++)
            t += tw[k];
        tcp->check = csum_fold32(t);
        goto ip_checksum;
    }
    udp->check = 0;
    if (cfg->flags & GEN_PARTIAL_CSUM) {
        /* What the kernel leaves in the field for the NIC to finish: the pseudo-header
         * sum, folded, not complemented. */
        __u32 p = (ip->saddr & 0xffff) + (ip->saddr >> 16) + (ip->daddr & 0xffff) +
                  (ip->daddr >> 16) + bpf_htons(IPPROTO_UDP) + udp->len;
        p = (p & 0xffff) + (p >> 16);
        p = (p & 0xffff) + (p >> 16);
        udp->check = (__u16)p;
    }
ip_checksum:
    ip->check = 0;
    __u32 sum = 0;
    __u16 *w = (__u16 *)ip;
#pragma unroll
    for (int k = 0; k < 10; k++)
        sum += w[k];
    ip->check = csum_fold32(sum);
    return bpf_redirect(cfg->ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
