//! A sequence of frames through a fast-path and a general-path engine
//! (`juneau_dataplane_fuzz::check_engine` says what must hold, `Records` the format).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| juneau_dataplane_fuzz::check_engine(data));
