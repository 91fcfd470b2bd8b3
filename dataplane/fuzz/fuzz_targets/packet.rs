//! One frame through the packet parsers and every rewrite the engine applies
//! (`juneau_dataplane_fuzz::check_packet` says what must hold).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| juneau_dataplane_fuzz::check_packet(data));
