//! `contrib/sce.toml`, the example configuration beside the README, stays valid: it loads
//! (unknown keys are refused there) and every export's cache settings parse.

use sce_server::ConfigFile;
use std::path::Path;

#[test]
fn the_example_configuration_loads_and_checks() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/sce.toml");
    let file = ConfigFile::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
    assert_eq!(file.listen, ["unix:/run/sce/lun0.sock"]);
    let names: Vec<&str> = file.export.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["lun0", "iso"]);
    for e in &file.export {
        let core = sce_server::export::core_of(e).unwrap_or_else(|x| panic!("{}: {x:#}", e.name));
        if e.name == "lun0" {
            // The default geometry: 512 KiB lines in 1 MiB fragments (the example once set
            // `fragment_size = "1MiB"` as "the cache line", which made whole 1 MiB lines).
            assert_eq!(
                (core.fragment_size, core.heat_bytes()),
                (512 << 10, 1 << 20)
            );
            assert_eq!(core.write_mode.to_string(), "writethrough");
            assert_eq!(core.writeback, sce_core::WritebackTuning::default());
        }
    }
}
