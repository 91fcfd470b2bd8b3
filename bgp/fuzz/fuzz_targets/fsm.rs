//! A BGP session FSM driven by arbitrary events and bytes
//! (`juneau_bgp_fuzz::check_fsm` says what must hold and how the input is read).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| juneau_bgp_fuzz::check_fsm(data));
