//! The whole-loop cost measurement's record (the real dataplane under callgrind).
//! The `loopcost` module measures it.

use serde::{Deserialize, Serialize};

/// One measured case.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoopCase {
    /// What was sent.
    pub name: String,
    /// Flows in the flow table during the window.
    pub flows: u32,
    /// Packets the dataplane received in the window (`rx_packets`).
    pub packets: u64,
    /// Instructions of the whole process in the window.
    pub instructions: u64,
    /// Of which, instructions the process spends without traffic for as long
    /// (subtracted).
    pub idle_instructions: u64,
    /// (instructions - idle) / packets.
    pub instructions_per_packet: f64,
    /// instructions / packets (nothing subtracted).
    pub gross_instructions_per_packet: f64,
}

/// The whole-loop measurement.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoopCost {
    /// What was measured, or why not.
    pub status: String,
    /// The cases measured.
    pub cases: Vec<LoopCase>,
    /// Instructions per second of the process without traffic.
    pub idle_instructions_per_s: f64,
}
