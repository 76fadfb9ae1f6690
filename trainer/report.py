"""Human-readable views of a plan: the region map table."""
from trainer.planner import Plans


def region_table(plans: Plans) -> str:
    p = plans.main
    rows = [f"{'idx':>3}  {'region':<22} {'enabled':<7} {'tensors':>7} {'bytes':>15} {'base_offset':>15}"]
    for r in p.layout():
        rows.append(f"{r['index']:>3}  {r['name']:<22} {'yes' if r['enabled'] else 'no':<7} "
                    f"{len(r['tensors']):>7} {r['bytes']:>15,} {r['base_offset']:>15,}")
    rows.append(f"total {p.total_bytes:,} bytes ({p.total_bytes / 2**20:.1f} MiB) in one arena; "
                f"{len(p.tensors)} tensors; variants: "
                + ", ".join(f"{v.name} {v.batch}x{v.resolution}" for v in plans.variants)
                + f"; fingerprint {plans.fingerprint()}")
    if p.config.shards > 1:
        s = p.sharding()
        rows.append(f"optimizer state sharded over {s['shards']} ranks ({', '.join(s['sharded_regions'])}): "
                    f"{s['bytes_per_gpu']:,} bytes a GPU where replicated it takes {s['replicated_bytes']:,}, "
                    f"{s['saved_bytes_per_gpu']:,} bytes saved; the shares' padding adds {s['padding_bytes']:,} to the "
                    f"weights and gradients, so the arena is {s['arena_saved_bytes']:,} bytes smaller")
    return "\n".join(rows)
