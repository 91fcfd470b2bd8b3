//! Arbitrary bytes through the BGP framer, decoder and UPDATE walk
//! (`juneau_bgp_fuzz::check_decode` says what must hold).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| juneau_bgp_fuzz::check_decode(data));
