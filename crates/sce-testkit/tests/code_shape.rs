//! The shape rule of issue 12: no source file in `crates/*/src` over 600 lines and no function
//! over 80 lines, unless a comment says why it must be so: a line containing `shape-rule:`
//! in the file's first 20 lines (for the file) or in the 5 lines above the function's
//! `fn` line (for that function).

use std::path::{Path, PathBuf};

const MAX_FILE: usize = 600;
const MAX_FN: usize = 80;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The start of a function definition (not a declaration ending in `;`), and its indent.
fn fn_start(line: &str) -> Option<usize> {
    let t = line.trim_start();
    let indent = line.len() - t.len();
    let mut rest = t;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    rest.starts_with("fn ").then_some(indent)
}

/// Functions longer than `MAX_FN` lines in `text`: (line number, name, length).
fn long_functions(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(indent) = fn_start(l) else { continue };
        let close = format!("{}}}", " ".repeat(indent));
        // A one-line body, or a declaration without a body.
        if l.trim_end().ends_with('}') || l.trim_end().ends_with(';') {
            continue;
        }
        let Some(len) = lines[i + 1..].iter().position(|x| *x == close) else {
            continue;
        };
        let len = len + 2;
        let excused = lines[i.saturating_sub(5)..i]
            .iter()
            .any(|x| x.contains("shape-rule:"));
        if len > MAX_FN && !excused {
            let name = l.split("fn ").nth(1).unwrap_or(l);
            let name = name.split(['(', '<']).next().unwrap_or(name).to_string();
            out.push((i + 1, name, len));
        }
    }
    out
}

#[test]
fn no_file_over_600_lines_and_no_function_over_80() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for c in std::fs::read_dir(&root).unwrap() {
        let src = c.unwrap().path().join("src");
        if src.is_dir() {
            sources(&src, &mut files);
        }
    }
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let n = text.lines().count();
        let file_excused = text.lines().take(20).any(|l| l.contains("shape-rule:"));
        if n > MAX_FILE && !file_excused {
            bad.push(format!("{}: {n} lines", f.display()));
        }
        for (line, name, len) in long_functions(&text) {
            bad.push(format!("{}:{line}: {name}: {len} lines", f.display()));
        }
    }
    assert!(bad.is_empty(), "over the shape rule:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_finds_a_long_function() {
    let mut text = String::from("/// doc\npub fn long() {\n");
    for _ in 0..MAX_FN {
        text.push_str("    x();\n");
    }
    text.push_str("}\nfn short() {\n    y();\n}\n");
    let found = long_functions(&text);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].2, MAX_FN + 2);
    let excused = format!("// shape-rule: a table\n{text}");
    assert!(long_functions(&excused).is_empty());
}
