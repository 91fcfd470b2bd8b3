/* Shared helpers for the perf harness's XDP programs (parsing, checksums). */
#pragma once
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* Parses Ethernet/IPv4 (no options)/UDP; returns 0 and sets the pointers, -1 otherwise. */
static __always_inline int parse_udp4(struct xdp_md *ctx, struct ethhdr **eth, struct iphdr **ip,
                                      struct udphdr **udp)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *e = data;
    if ((void *)(e + 1) > end || e->h_proto != bpf_htons(ETH_P_IP))
        return -1;
    struct iphdr *i = (void *)(e + 1);
    if ((void *)(i + 1) > end || i->ihl != 5 || i->protocol != IPPROTO_UDP)
        return -1;
    struct udphdr *u = (void *)(i + 1);
    if ((void *)(u + 1) > end)
        return -1;
    *eth = e;
    *ip = i;
    *udp = u;
    return 0;
}

static __always_inline __u16 csum_fold32(__u32 c)
{
    c = (c & 0xffff) + (c >> 16);
    c = (c & 0xffff) + (c >> 16);
    return (__u16)~c;
}

/* RFC 1624 incremental update of a 16-bit one's complement checksum for a 32-bit field. */
static __always_inline void csum_replace4(__u16 *sum, __u32 from, __u32 to)
{
    __u32 c = (__u16)~*sum;
    c += (~from & 0xffff) + (~from >> 16) + (to & 0xffff) + (to >> 16);
    *sum = csum_fold32(c);
}

static __always_inline void csum_replace2(__u16 *sum, __u16 from, __u16 to)
{
    __u32 c = (__u16)~*sum;
    c += (__u16)~from + to;
    *sum = csum_fold32(c);
}

/* UDP checksum 0 means "none" and stays so; a computed 0 is sent as 0xffff. */
static __always_inline void udp_csum_replace4(struct udphdr *u, __u32 from, __u32 to)
{
    if (u->check == 0)
        return;
    csum_replace4(&u->check, from, to);
    if (u->check == 0)
        u->check = 0xffff;
}

static __always_inline void udp_csum_replace2(struct udphdr *u, __u16 from, __u16 to)
{
    if (u->check == 0)
        return;
    csum_replace2(&u->check, from, to);
    if (u->check == 0)
        u->check = 0xffff;
}

/* A one-entry array holding a UDP destination port (network byte order) a program acts on. */
#define PORT_MAP(name)                      \
    struct {                                \
        __uint(type, BPF_MAP_TYPE_ARRAY);   \
        __uint(max_entries, 1);             \
        __type(key, __u32);                 \
        __type(value, __u32);               \
    } name SEC(".maps")

/* Parses a UDP/IPv4 frame to the port `port_map` holds; returns 0 and sets the pointers, -1
 * for anything else (the caller passes it to the kernel). */
static __always_inline int parse_udp4_to(struct xdp_md *ctx, void *port_map, struct ethhdr **eth,
                                         struct iphdr **ip, struct udphdr **udp)
{
    if (parse_udp4(ctx, eth, ip, udp) < 0)
        return -1;
    __u32 zero = 0;
    __u32 *port = bpf_map_lookup_elem(port_map, &zero);
    if (!port || (*udp)->dest != (__u16)*port)
        return -1;
    return 0;
}

/* Rewrites the destination (`dst` true) or source address and port of a UDP/IPv4 packet and
 * decrements its TTL, checksums updated incrementally. */
static __always_inline void nat_udp4(struct iphdr *ip, struct udphdr *udp, int dst, __u32 addr,
                                     __u16 port)
{
    __u32 *ip_field = dst ? &ip->daddr : &ip->saddr;
    __u16 *port_field = dst ? &udp->dest : &udp->source;
    __u32 old_ip = *ip_field;
    __u16 old_port = *port_field;
    *ip_field = addr;
    *port_field = port;
    csum_replace4(&ip->check, old_ip, addr);
    udp_csum_replace4(udp, old_ip, addr);
    udp_csum_replace2(udp, old_port, port);
    /* TTL decrement, like a router. */
    __u16 old_ttl_word = *(__u16 *)&ip->ttl;
    ip->ttl -= 1;
    csum_replace2(&ip->check, old_ttl_word, *(__u16 *)&ip->ttl);
}
