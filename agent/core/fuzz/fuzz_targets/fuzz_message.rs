//! Fuzz the generic `wire::Message::decode` (all types) plus `peek_type` and
//! `is_cancel_want`: never panic; agree with each other; round-trip exactly.
#![no_main]

use kvfabric_core::wire::{is_cancel_want, peek_type, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = Message::decode(data);
    let peeked = peek_type(data);
    let cancel = is_cancel_want(data);
    match decoded {
        Ok(m) => {
            assert_eq!(peeked, Ok(m.message_type()));
            assert_eq!(cancel, matches!(&m, Message::Want(w) if w.is_cancel()));
            let enc = m.encode();
            assert_eq!(enc.as_slice(), data, "encoding is not canonical");
            assert_eq!(Message::decode(&enc).expect("re-decode"), m);
        }
        Err(_) => assert!(!cancel),
    }
});
