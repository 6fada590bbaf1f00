//! The hypervisor's steal time (Linux `/proc/stat`): on a virtual machine, CPU time the host gave
//! to something else while this guest's vCPUs had work. `serve bench` prints, beside each run's
//! figures, the share of the time the guest's CPUs wanted (busy or stolen, not idle) that the host
//! took: a run that lost a tenth of it is not comparable with one that lost none.

use std::io::Read;

/// The machine's CPU time so far, in clock ticks: the time its CPUs wanted (all but idle and
/// I/O wait), and the part of it stolen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CpuTimes {
    steal: u64,
    wanted: u64,
}

/// Most bytes of `/proc/stat` read (its first line is all that is used).
const MAX_STAT_BYTES: u64 = 1 << 16;

/// The CPU times now; `None` where the system does not say (not Linux, or no steal field).
pub(crate) fn now() -> Option<CpuTimes> {
    let mut text = String::new();
    std::fs::File::open("/proc/stat").ok()?.take(MAX_STAT_BYTES).read_to_string(&mut text).ok()?;
    parse(&text)
}

/// The share of the CPU time wanted between two readings that was stolen (0 to 1), if both exist
/// and the CPUs wanted any.
pub(crate) fn share(before: Option<CpuTimes>, after: Option<CpuTimes>) -> Option<f64> {
    let (b, a) = (before?, after?);
    let wanted = a.wanted.checked_sub(b.wanted).filter(|&t| t > 0)?;
    Some((a.steal.saturating_sub(b.steal) as f64 / wanted as f64).min(1.0))
}

/// `, 3.1% of the CPU stolen` after a measurement's figures, or nothing when not known.
pub(crate) fn note(share: Option<f64>) -> String {
    share.map_or(String::new(), |s| format!(", {:.1}% of the CPU stolen", s * 100.0))
}

/// The summed `cpu` line: `cpu user nice system idle iowait irq softirq steal [guest guest_nice]`
/// (guest time is already counted in user and nice).
fn parse(text: &str) -> Option<CpuTimes> {
    let line = text.lines().next()?;
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let ticks: Vec<u64> = fields.take(8).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    if ticks.len() != 8 {
        return None;
    }
    // user nice system [idle iowait] irq softirq steal.
    let wanted = [0, 1, 2, 5, 6, 7].iter().try_fold(0u64, |sum, &i| sum.checked_add(ticks[i]))?;
    Some(CpuTimes { steal: ticks[7], wanted })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steal_share_is_read_from_the_summed_cpu_line() {
        let before = parse("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n").unwrap();
        let after = parse("cpu  200 0 100 1500 10 0 0 90 0 0\n").unwrap();
        assert_eq!(before, CpuTimes { steal: 40, wanted: 190 });
        // Between them the CPUs wanted 100 + 50 + 50 ticks (700 idle ones not counted), and 50
        // of those were stolen.
        assert!((share(Some(before), Some(after)).unwrap() - 50.0 / 200.0).abs() < 1e-12);
        assert_eq!(share(Some(after), Some(after)), None, "no time passed");
        assert_eq!(share(None, Some(after)), None);
        // Kernels before 2.6.11 had no steal field; anything else is not the summed line.
        assert_eq!(parse("cpu  1 2 3 4 5 6 7\n"), None);
        assert_eq!(parse("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(parse("cpu  1 2 x 4 5 6 7 8\n"), None);
        assert_eq!(parse(""), None);
        if cfg!(target_os = "linux") {
            assert!(now().is_some(), "Linux has /proc/stat with a steal field");
        }
    }
}
