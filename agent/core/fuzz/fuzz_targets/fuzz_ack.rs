//! Fuzz `wire::decode_ack`: never panics; on success the message re-encodes
//! to exactly the input (the encoding is canonical) and decodes back equal.
#![no_main]

use kvfabric_core::wire::{decode_ack, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = decode_ack(data) {
        let msg = Message::Ack(m);
        let enc = msg.encode();
        assert_eq!(enc.len(), msg.encoded_len());
        assert_eq!(enc.as_slice(), data, "encoding is not canonical");
        assert_eq!(decode_ack(&enc).expect("re-decode"), m);
        assert_eq!(Message::decode(&enc).expect("generic decode"), msg);
        msg.check_limits().expect("decoded message within limits");
    }
});
