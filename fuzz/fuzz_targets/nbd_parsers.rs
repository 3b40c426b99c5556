//! Fuzzes the pure NBD parsers: option headers, INFO/GO data, meta context requests, export
//! names, request headers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sce_nbd::proto;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = <&[u8; 16]>::try_from(data.get(..16).unwrap_or(&[])) {
        let _ = proto::parse_option_header(h);
    }
    if let Ok(h) =
        <&[u8; proto::REQUEST_LEN]>::try_from(data.get(..proto::REQUEST_LEN).unwrap_or(&[]))
    {
        if let Ok(r) = proto::parse_request(h) {
            assert_eq!(proto::parse_request(&proto::encode_request(&r)), Ok(r));
        }
    }
    let _ = proto::parse_info_request(data);
    let _ = proto::parse_meta_context_request(data);
    let _ = proto::parse_export_name(data);
});
