#![no_main]
//! Feeds arbitrary bytes to the framer, the full decoder and the cheap UPDATE walk.

use juneau_bgp::wire::{decode, frame, inspect_update, message_type, msg_type, DecodeContext};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode(data, DecodeContext::default());
    if let Ok(Some(len)) = frame(data) {
        let msg = &data[..len];
        for four_octet_as in [true, false] {
            let _ = decode(msg, DecodeContext { four_octet_as });
        }
        if message_type(msg) == msg_type::UPDATE {
            let _ = inspect_update(msg);
        }
    }
});
