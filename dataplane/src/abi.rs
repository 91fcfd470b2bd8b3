//! What the steering program (`bpf/steer.c`) and Rust must agree on: the one definition
//! of every shared constant and of each shared struct's size. `build.rs` turns each
//! `pub const NAME: TYPE = VALUE;` line of this file into `#define NAME VALUE` in the
//! header `juneau_abi.h` the program is compiled with, so neither side spells a number
//! the other could drift from; the program checks each struct's size against its
//! `*_BYTES` here (`_Static_assert`), Rust its own (`const _: () = assert!`). What the
//! program does with them is checked against the engine by the differential tests
//! (`fast.rs`, `steering.rs`: the program under `BPF_PROG_TEST_RUN`).
//!
//! The format is deliberately plain: one constant per line, a value made of integer
//! literals (underscores allowed), other constants of this file, `+ - * << ( )`.

/// `ifaces` role of an uplink.
pub const ROLE_UPLINK: u32 = 0;
/// `ifaces` role of a Pod interface.
pub const ROLE_POD: u32 = 1;
/// Uplinks the program tells apart (`uplinks`).
pub const MAX_UPLINKS: usize = 4;

/// Marks an initialised shared flow table ("JUNEAUFT").
pub const FLOW_MAGIC: u64 = 0x4a55_4e45_4155_4654;
/// Version of the shared flow-table layout (header, record, index slot, hash). Bump it
/// with any change to them or to the program's maps: a pinned table of another version
/// is never read, a fresh one is made.
pub const FLOW_LAYOUT_VERSION: u32 = 2;
/// Most flow tables in a group (forwarding workers).
pub const MAX_WORKERS: usize = 16;
/// No key is stored further than this many slots from its home slot (the program's
/// probe bound).
pub const MAX_PROBE: usize = 128;
/// `FlowState::Established`.
pub const STATE_ESTABLISHED: u8 = 2;
/// `FlowState::Udp`.
pub const STATE_UDP: u8 = 5;

/// TCP flag bits (byte 13 of the TCP header).
pub const TCP_FIN: u8 = 0x01;
/// SYN.
pub const TCP_SYN: u8 = 0x02;
/// RST.
pub const TCP_RST: u8 = 0x04;

/// Entries of one worker's part of `fast_slots`: its head, its slots, its reply-egress
/// entries.
pub const FAST_STRIDE: usize = 32_768;
/// Reply-egress entries at the end of each part: the engine's reply next-hop cache size.
pub const FAST_EGRESS: usize = 256;
/// Slots per worker's part after its head.
pub const FAST_SLOTS: usize = FAST_STRIDE - 1 - FAST_EGRESS;
/// One packet in a packed traffic counter (packets above, bytes below this bit).
pub const TRAFFIC_PACKET: u64 = 1 << 36;

/// `steer_drops` index: no frontend for the packet's VIP:port.
pub const SD_PORT_NOT_EXPOSED: u32 = 0;
/// `steer_drops` index: not TCP or UDP to a VIP.
pub const SD_UNSUPPORTED_PROTOCOL: u32 = 1;
/// `steer_drops` index: over the new-flow admission of its source /24.
pub const SD_NEW_FLOW_PREFIX_RATE: u32 = 2;
/// `steer_drops` index: no AF_XDP socket on the queue.
pub const SD_NO_SOCKET: u32 = 3;
/// `steer_drops` index: a redirect from a node that is no peer.
pub const SD_REDIRECT_NOT_FROM_PEER: u32 = 4;
/// `steer_drops` index: a client outside the Service's source ranges.
pub const SD_SOURCE_RANGE_DENIED: u32 = 5;

/// Bit of a `frontends` value: the frontend is exposed.
pub const FRONTEND_EXPOSED: u8 = 1;
/// Bit of a `frontends` value: its Service has source ranges (only a source in
/// `source_ranges` is admitted).
pub const FRONTEND_FILTERED: u8 = 2;
/// Bit of a `frontends` value: its backends are this node's own stack (host-network
/// Pods): the program passes the frontend's packets to the kernel, whose DNAT the
/// dataplane programs (`host_network.rs`), after the source ranges, before the new-flow
/// admission (the kernel's connections are in no table of ours).
pub const FRONTEND_HOST_NETWORK: u8 = 4;

/// `struct iface_conf`.
pub const IFACE_CONF_BYTES: usize = 12;
/// `struct uplink_set`.
pub const UPLINK_SET_BYTES: usize = 4 * MAX_UPLINKS + IFACE_CONF_BYTES * MAX_UPLINKS;
/// `struct frontend_key`.
pub const FRONTEND_KEY_BYTES: usize = 8;
/// `struct source_range_key` (its prefix length, then the frontend and the address).
pub const SOURCE_RANGE_KEY_BYTES: usize = 4 + FRONTEND_KEY_BYTES + 4;
/// `struct admit_conf`: the rate and burst per source prefix, and the seed of the
/// prefixes' slots in `admit_open`.
pub const ADMIT_CONF_BYTES: usize = 24;
/// Slots of `admit_open` (one `u64` each, a power of two): source prefixes hash into them.
pub const ADMIT_SLOTS: usize = 65536;
/// `struct flow_meta`: a flow table's header.
pub const FLOW_META_BYTES: usize = 64;
/// `struct flow`: one flow record.
pub const FLOW_RECORD_BYTES: usize = 32;
/// `struct fast_head`, `struct fast_egress`, `struct fast_slot`: one entry of
/// `fast_slots` each.
pub const FAST_ENTRY_BYTES: usize = 64;
/// `struct frontend6_key`: an IPv6 VIP, port, protocol and a pad byte.
pub const FRONTEND6_KEY_BYTES: usize = 16 + 2 + 1 + 1;
/// `struct flow6_key`: an IPv6 flow's key in one direction (addresses, ports, protocol,
/// three pad bytes).
pub const FLOW6_KEY_BYTES: usize = 16 + 16 + 2 + 2 + 1 + 3;
