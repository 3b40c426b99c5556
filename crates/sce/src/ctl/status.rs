//! How `sce ctl status` prints a server's status.

use super::size;
use serde_json::Value;

pub(super) fn print_status(v: &Value) {
    println!(
        "sce {} up {:.0} s, {} open connection(s)",
        v["version"].as_str().unwrap_or("?"),
        v["uptime_seconds"].as_f64().unwrap_or(0.0),
        v["open_connections"]
    );
    for e in v["exports"].as_array().into_iter().flatten() {
        println!(
            "export {}  {}  {}",
            e["name"],
            size(&e["size_bytes"]),
            e["state"].as_str().unwrap_or("?")
        );
        print_source(e);
        if e["cached"] != Value::Bool(true) {
            continue;
        }
        let pct = |x: &Value| format!("{:.1}%", x.as_f64().unwrap_or(0.0) * 100.0);
        println!(
            "  {:<12} {}  admission {}  line {} (fragment {})  {}",
            "mode",
            e["mode"].as_str().unwrap_or("?"),
            e["admission"].as_str().unwrap_or("?"),
            size(&e["line_size_bytes"]),
            size(&e["fragment_size_bytes"]),
            if e["persistent"] == Value::Bool(true) {
                "persistent"
            } else {
                "not persistent"
            }
        );
        if let Some(w) = e.get("writeback") {
            print_writeback(w);
        }
        print_shared(e);
        println!(
            "  {:<12} {} of {} ({})",
            "occupancy",
            size(&e["occupancy_bytes"]),
            size(&e["cache_bytes"]),
            pct(&e["occupancy_ratio"])
        );
        let window = e["rates_window_seconds"].as_f64();
        let recent = match (e["recent_read_hit_ratio"].as_f64(), window) {
            (Some(r), Some(w)) => format!(", {:.1}% over the last {w:.0} s", r * 100.0),
            (None, Some(w)) => format!(", no reads over the last {w:.0} s"),
            _ => String::new(),
        };
        let since = match e["read_pages"].as_u64() {
            Some(0) => "no reads since start".to_string(),
            _ => format!(
                "{} of the pages read since start",
                pct(&e["read_hit_ratio"])
            ),
        };
        println!("  {:<12} {since}{recent}", "read hits");
        println!(
            "  {:<12} populations {:.1}/s, evictions {:.1}/s",
            "rates",
            e["populations_per_second"].as_f64().unwrap_or(0.0),
            e["evictions_per_second"].as_f64().unwrap_or(0.0)
        );
        let er = &e["errors"];
        println!(
            "  {:<12} cache read {}, cache write {}, checksum {}",
            "errors", er["cache_read"], er["cache_write"], er["cache_checksum"]
        );
        print_own(e, &pct);
    }
}

/// The source line of an export in `status`: said when it is failing (the reason and
/// since when), or when it ever failed (its errors, and the last).
fn print_source(e: &Value) {
    let src = &e["source"];
    if let Some(reason) = e["state_reason"].as_str() {
        println!("  {:<12} {reason}", "degraded");
        return;
    }
    let errors: u64 = src["errors"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
    if errors > 0 {
        let ago = src["last_error_time"].as_f64().map_or(String::new(), |t| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            format!(" {:.0} s ago", (now - t).max(0.0))
        });
        println!(
            "  {:<12} up; {errors} failed request(s), the last{ago}: {}",
            "source",
            src["last_error"].as_str().unwrap_or("?")
        );
    }
}

/// The write-back line of an export in `status`, from its `writeback` object `w`.
fn print_writeback(w: &Value) {
    // What the source refuses and what was found damaged, when there is any.
    let mut trouble = String::new();
    if w["stuck_bytes"].as_u64().is_some_and(|n| n > 0) {
        trouble += &format!(", {} the source refuses (retried)", size(&w["stuck_bytes"]));
    }
    if w["damaged_pages"].as_u64().is_some_and(|n| n > 0) {
        trouble += &format!(", {} pages found damaged", w["damaged_pages"]);
    }
    if let Some(r) = w["cleaned_bytes_per_second"].as_f64().filter(|&r| r > 0.0) {
        let eta = w["clean_eta_seconds"].as_f64().unwrap_or(0.0);
        trouble += &format!(
            ", cleaning {}/s (the dirty data in {eta:.0} s at this pace)",
            sce_core::units::format_size(r as u64)
        );
    }
    if w["log_lent_bytes"].as_u64().is_some_and(|n| n > 0) {
        trouble += &format!(
            ", the log holds up to {} of {} ({} lent by the read cache)",
            size(&w["log_capacity_bytes"]),
            size(&w["log_max_bytes"]),
            size(&w["log_lent_bytes"])
        );
    }
    if w["sequential_bytes"].as_u64().is_some_and(|n| n > 0) {
        trouble += &format!(
            ", {} of sequential streams written through",
            size(&w["sequential_bytes"])
        );
    }
    println!(
        "  {:<12} {} dirty, {} lost, {} written back, {} waits, {} clean errors{}{}",
        "writeback",
        size(&w["dirty_bytes"]),
        size(&w["lost_bytes"]),
        size(&w["cleaned_bytes"]),
        w["waits"],
        w["clean_errors"],
        trouble,
        match w["last_clean_error"].as_str() {
            Some(x) if !x.is_empty() => format!(" (last: {x})"),
            _ => String::new(),
        }
    );
    if let (Some(lo), Some(hi)) = (w["low_watermark"].as_f64(), w["high_watermark"].as_f64()) {
        println!(
            "  {:<12} cleans from {:.0}% of the log, urgently above {:.0}%, in the background at {}",
            "",
            lo * 100.0,
            hi * 100.0,
            match w["rate_bytes_per_second"].as_u64() {
                Some(0) | None => "any rate".to_string(),
                Some(r) => format!("{}/s at most", sce_core::units::format_size(r)),
            }
        );
    }
}

/// An export's own figures; for one that shares its cache device, the lines above are the
/// device's.
fn print_own(e: &Value, pct: &dyn Fn(&Value) -> String) {
    if let Some(with) = e["shared_with"].as_array() {
        let names: Vec<&str> = with.iter().filter_map(Value::as_str).collect();
        println!(
            "  {:<12} with {} (the figures above are the device's)",
            "shared",
            names.join(", ")
        );
    }
    let share = e
        .get("export_dirty_share_bytes")
        .map_or(String::new(), |s| format!(" of {} it may hold", size(s)));
    let dirty = e
        .get("export_dirty_bytes")
        .map_or(String::new(), |d| format!(", {} dirty{share}", size(d)));
    println!(
        "  {:<12} {} cached{dirty}; {} of its {} read requests hit whole",
        "this export",
        size(&e["export_cached_bytes"]),
        pct(&e["export_read_hit_ratio"]),
        e["export_read_requests"]
    );
}

/// The shared-mode line of an export in `status`.
fn print_shared(e: &Value) {
    let Some(sh) = e.get("shared") else { return };
    println!(
        "  {:<12} {} as {}: {}, revision {}, {} writes published ({:.2} ms mean, {} failed), {} invalidations received ({} dropped), {} reads passed through",
        "shared",
        sh["volume"].as_str().unwrap_or("?"),
        sh["host"].as_str().unwrap_or("?"),
        if sh["serving_hits"] == Value::Bool(true) {
            "serving hits"
        } else {
            "passing reads through (no valid lease or not caught up)"
        },
        sh["revision_processed"],
        sh["writes_published"],
        sh["mean_publish_seconds"].as_f64().unwrap_or(0.0) * 1e3,
        sh["publish_failures"],
        sh["invalidations_received"],
        size(&sh["dropped_bytes"]),
        sh["passthrough_reads"],
    );
}

/// Lines `exists` lists one by one at most (`--json` lists every one).
const EXISTS_LISTED: usize = 16;

pub(super) fn print_exists(v: &Value) {
    let lines = v["fragments"].as_array().map_or(&[][..], Vec::as_slice);
    let (cached, len) = (v["cached_bytes"].as_u64(), v["len"].as_u64());
    let pct = match (cached, len) {
        (Some(c), Some(l)) if l > 0 => format!(" ({:.1}%)", c as f64 * 100.0 / l as f64),
        _ => String::new(),
    };
    println!(
        "{} of {} cached{pct}, in {} line(s)",
        size(&v["cached_bytes"]),
        size(&v["len"]),
        lines.len()
    );
    if lines.len() > EXISTS_LISTED {
        println!("  (--json lists each line)");
        return;
    }
    for f in lines {
        println!(
            "  line at {:>14}  {:>10} cached",
            f["offset"].as_u64().unwrap_or(0),
            size(&f["cached_bytes"])
        );
    }
}
