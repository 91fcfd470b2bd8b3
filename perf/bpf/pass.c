/* `xdp_pass`, attached to veth ends that must accept XDP_REDIRECTed frames (a veth
 * delivers redirected frames only to a peer with NAPI: an XDP program gives it one). */
#include "common.h"

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
    return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
