//! The GPU bench card's rows, their timing and the side-by-side table.

/// One measured braid workload (or variant).
#[derive(Clone, Debug)]
pub struct Row {
    pub id: &'static str,
    pub name: String,
    pub ms: f64,
    /// Bytes a memory-bound workload must move (read + write), for its bandwidth.
    pub bytes: Option<f64>,
    /// Flops of a compute-bound one: those of the matrix products its step ran.
    pub flops: Option<f64>,
    pub peak_extra: u64,
    pub kernels: usize,
    /// Matrix products braid's step ran, and the number the workload has by construction.
    pub products: Option<(usize, usize)>,
    /// What both sides compute and hold, and how braid's result was checked.
    pub check: String,
    pub target: &'static str,
    /// Peer variant this row is compared with (`eager`, `save_on_cpu`, ...); `None`: the best.
    pub against: Option<&'static str>,
    /// Further variants measured with it (G4 on two streams, G5 under a budget).
    pub extra: Vec<Row>,
}

impl Row {
    pub fn line(&self) -> String {
        let mut s = format!(
            "{} {}: {:.3} ms, {} kernels, peak +{:.1} MiB",
            self.id,
            self.name,
            self.ms,
            self.kernels,
            self.peak_extra as f64 / (1 << 20) as f64
        );
        if let Some(b) = self.bytes {
            s += &format!(", {:.1} GB/s", b / self.ms / 1e6);
        }
        if let Some(f) = self.flops {
            s += &format!(", {:.1} TFLOP/s", f / self.ms / 1e9);
        }
        s + &format!("; {}", self.check)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id, "name": self.name, "ms": self.ms, "bytes": self.bytes, "flops": self.flops,
            "peak_extra_bytes": self.peak_extra, "kernels": self.kernels,
            "products": self.products.map(|p| p.0), "products_expected": self.products.map(|p| p.1),
            "check": self.check, "target": self.target,
        })
    }
}

pub use super::timing::median_ms;

/// GB/s of one host memcpy of 256 MiB (read + write counted): the CPU's copy floor.
pub fn host_copy_gbs() -> f64 {
    let n = 64 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let ms = median_ms(2, 9, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    });
    2.0 * 4.0 * n as f64 / ms / 1e6
}

/// The side-by-side table in Markdown: braid's rows with the peers' times and the ratios, then
/// every row's check line (what both sides compute, how braid's result was checked).
pub fn table(
    rows: &[Row],
    peers: &[super::PeerRow],
    copy_floor_gbs: Option<f64>,
    peer_status: &Result<Vec<super::PeerRow>, String>,
) -> String {
    let mut out = String::from(
        "| id | workload | braid ms | GB/s (% of copy) | TFLOP/s | peak + MiB | kernels | products | peers (ms) | braid / peer |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let base = r.id.split('-').next().unwrap_or(r.id);
        let mine: Vec<&super::PeerRow> = peers.iter().filter(|p| p.id == base).collect();
        let peer_text = mine.iter().map(|p| format!("{} {:.3}", p.variant, p.ms)).collect::<Vec<_>>().join("; ");
        let compare = match r.against {
            Some(v) => mine.iter().find(|p| p.variant == v).copied(),
            None => mine.iter().min_by(|a, b| a.ms.partial_cmp(&b.ms).unwrap()).copied(),
        };
        let bw = r.bytes.map(|b| {
            let gbs = b / r.ms / 1e6;
            match copy_floor_gbs {
                Some(f) => format!("{gbs:.1} ({:.0}%)", 100.0 * gbs / f),
                None => format!("{gbs:.1}"),
            }
        });
        out += &format!(
            "| {} | {} | {:.3} | {} | {} | {:.1} | {} | {} | {} | {} |\n",
            r.id,
            r.name,
            r.ms,
            bw.unwrap_or_default(),
            r.flops.map(|f| format!("{:.1}", f / r.ms / 1e9)).unwrap_or_default(),
            r.peak_extra as f64 / (1 << 20) as f64,
            r.kernels,
            r.products.map(|(ran, expected)| format!("{ran}/{expected}")).unwrap_or_else(|| "-".into()),
            if peer_text.is_empty() { "-".into() } else { peer_text },
            compare.map(|p| format!("{:.2} ({})", r.ms / p.ms, p.variant)).unwrap_or_else(|| "-".into()),
        );
    }
    out += &format!(
        "\nCopy floor: {}. Peers: {}. Products: the matrix products braid's step ran / the workload's (and its peer's) by construction.\n",
        copy_floor_gbs.map_or("not measured".into(), |f| format!("{f:.0} GB/s (read + write)")),
        match peer_status {
            Ok(p) => format!("{} rows from benches/peers/gpu_torch.py", p.len()),
            Err(e) => format!("not run: {e}"),
        }
    );
    for r in rows {
        out += &format!("- {}: {}.", r.id, r.check);
        if let Some(p) = peers.iter().find(|p| p.id == format!("{}-host", r.id)) {
            out += &format!(
                " PyTorch's host enqueues the same work in {:.1} us per product and its tanh (what one braid kernel runs).",
                p.ms
            );
        }
        if !r.target.is_empty() {
            out += &format!(" Target: {}.", r.target);
        }
        out += "\n";
    }
    out
}
