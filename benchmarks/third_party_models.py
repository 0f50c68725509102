"""Other people's 3D networks, as released, through ``spatialize``: each is exact against one
process (float64: output, loss, every gradient after hpcpar.DDP) or refused in one line, on
each grid. The source of the models guide's table ("MONAI's networks, as released").

    for g in 1x2x1x1 1x1x2x1 1x2x2x1 2x2x1x1; do      # a grid per process (below)
        mpiexec -n 4 python benchmarks/third_party_models.py --grids $g [--only m_unet,m_vnet]
    done

MONAI is a test dependency. nnU-Net's networks (``dynamic-network-architectures``), the
``unet`` package and pytorch-3dunet's join when installed (``pip install --no-deps
dynamic-network-architectures unet pytorch3dunet scikit-image``: nnU-Net's own requirements
would replace torch). Networks with dropout are compared
with hpcpar's own one-rank run (the masks are hpcpar's, the same on any grid); VAEs, which
sample per data replica, run on the spatial grids only. A network with several outputs is
wrapped the way a user combines them (``_Heads``). Prints one row per network and grid;
exits 1 if any is silently wrong or crashes. Each check closes its ``hpcpar.DDP`` (its
shared-memory gradient windows) and memory is trimmed between networks; a grid per process
keeps the peak lower still.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import sys

import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.testing.model_check import check_model
from tests.support.zoo import MONAI


def mse(out, target):
    return F.mse_loss(out, target)


def ce(out, target):
    return F.cross_entropy(out, target)


class _Heads(nn.Module):
    """A network's several outputs made one tensor as a user's loss would use them: the
    first, plus each further one reduced to one value per sample (deep-supervision heads,
    VAE terms). Per sample, so that data replicas, each holding its own samples, give what
    one process gives (a mean over the batch would couple them)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        out = self.net(x)
        if isinstance(out, torch.Tensor):
            return out
        first, *rest = [o for o in out if isinstance(o, torch.Tensor)]
        per_sample = (1,) * (first.dim() - 1)
        return first + sum(0.1 * o.square().mean(tuple(range(1, o.dim()))).view(-1, *per_sample)
                           for o in rest)


def _no_dropout(net):
    for m in net.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return net


def _monai():
    from monai.networks import nets as N  # deferred: only where MONAI is installed

    group = {"norm": ("group", {"num_groups": 4})}
    small = (4, 4, 8, 8, 8, 4)
    cube16, cube32 = (16, 16, 16), (32, 32, 32)

    # the six the zoo test runs, as it runs them; then the rest of the trial
    tested = {name.replace("monai_", "m_"): entry[:5] for name, entry in MONAI.items()}
    return tested | {  # name: (factory(c), channels, size, loss, target kind)
        "m_unet_instance_odd": (lambda c: N.UNet(3, c, 3, (4, 8), (2,), num_res_units=1,
                                                 norm="instance"), 1, (18, 14, 20), ce, "class"),
        "m_unet_batch_prelu": (lambda c: N.UNet(3, c, 2, (4, 8, 8), (2, 2), norm="batch",
                                                act="PRELU"), 2, cube16, mse, "like"),
        "m_unet_k5": (lambda c: N.UNet(3, c, 2, (4, 8, 8), (2, 1), kernel_size=5,
                                       up_kernel_size=3, num_res_units=1, adn_ordering="NA"),
                      1, (12, 10, 14), mse, "like"),
        "m_unet_dropout": (lambda c: N.UNet(3, c, 2, (4, 8), (2,), dropout=0.3,
                                            adn_ordering="NDA"), 1, cube16, mse, "like"),
        "m_basicunet": (lambda c: N.BasicUNet(3, c, 2, features=small), 1, cube32, mse, "like"),
        "m_basicunet_interp": (lambda c: N.BasicUNet(3, c, 2, features=small,
                                                     upsample="nontrainable"), 1, cube32, mse,
                               "like"),
        "m_basicunet_pixelshuffle": (lambda c: N.BasicUNet(3, c, 2, features=small,
                                                           upsample="pixelshuffle"), 1, cube32,
                                     mse, "like"),
        "m_basicunetplusplus_ds": (lambda c: _Heads(N.BasicUNetPlusPlus(
            3, c, 2, features=small, deep_supervision=True)), 1, cube32, mse, "like"),
        "m_segresnet_ds": (lambda c: _Heads(N.SegResNetDS(
            3, init_filters=8, in_channels=c, out_channels=2, blocks_down=(1, 1, 1), dsdepth=2,
            **group)), 1, cube16, mse, "like"),
        "m_segresnetvae": (lambda c: _Heads(N.SegResNetVAE(
            cube16, vae_estimate_std=False, vae_default_std=0.3, vae_nz=8, spatial_dims=3,
            init_filters=8, in_channels=c, out_channels=2, blocks_down=(1, 2), blocks_up=(1,),
            **group)), 1, cube16, mse, "like"),
        "m_vnet": (lambda c: _no_dropout(N.VNet(3, c, 2)), 1, cube32, mse, "like"),
        "m_dynunet_res_batch": (lambda c: N.DynUNet(3, c, 2, [3, 3, 3], [1, 2, 2], [2, 2],
                                                    norm_name="batch", res_block=True),
                                1, cube16, mse, "like"),
        "m_dynunet_ds": (lambda c: N.DynUNet(3, c, 2, [3, 3, 3], [1, 2, 2], [2, 2],
                                             norm_name="instance", deep_supervision=True,
                                             deep_supr_num=1), 1, cube16,
                         lambda o, t: mse(o[:, 0], t[:, 0]) + 0.5 * mse(o[:, 1], t[:, 0]),
                         "like"),
        "m_densenet": (lambda c: N.DenseNet(3, c, 3, init_features=4, growth_rate=4,
                                            block_config=(1, 1)), 1, cube16, ce, "class"),
        "m_resnet": (lambda c: N.ResNet("basic", [1, 1, 1, 1], [4, 8, 8, 8], n_input_channels=c,
                                        num_classes=3, spatial_dims=3, conv1_t_size=7,
                                        conv1_t_stride=2), 1, (64, 64, 64), ce, "class"),
        "m_resnet_small": (lambda c: N.ResNet("basic", [1, 1, 1, 1], [4, 8, 8, 8],
                                              n_input_channels=c, num_classes=3,
                                              spatial_dims=3), 1, cube16, ce, "class"),
        "m_senet": (lambda c: N.SENet(3, c, "se_resnet_bottleneck", [1, 1, 1, 1], groups=1,
                                      reduction=2, inplanes=8, downsample_kernel_size=1,
                                      input_3x3=False, num_classes=3), 1, cube32, ce, "class"),
        "m_efficientnet": (lambda c: N.EfficientNetBN("efficientnet-b0", pretrained=False,
                                                      spatial_dims=3, in_channels=c,
                                                      num_classes=3), 1, cube32, ce, "class"),
        "m_flexibleunet": (lambda c: N.FlexibleUNet(c, 2, "resnet10", spatial_dims=3,
                                                    pretrained=False), 1, cube32, mse, "like"),
        "m_autoencoder": (lambda c: N.AutoEncoder(3, c, c, (4, 8), (2, 2)), 1, cube16, mse,
                          "like"),
        "m_varautoencoder": (lambda c: _Heads(N.VarAutoEncoder(3, (c, *cube16), c, 8, (4, 8),
                                                               (2, 2))), 1, cube16, mse, "like"),
        "m_regunet": (lambda c: N.RegUNet(3, c, num_channel_initial=4, depth=2, out_channels=3),
                      2, cube16, mse, "like"),
        "m_localnet": (lambda c: N.LocalNet(3, c, 4, (0, 1, 2)), 2, cube16, mse, "like"),
        "m_classifier": (lambda c: N.Classifier((c, 12, 10, 14), 3, (4, 8), (2, 2)), 1,
                         (12, 10, 14), mse, "like"),
        "m_discriminator": (lambda c: N.Discriminator((c, 12, 10, 14), (4, 8), (2, 2)), 1,
                            (12, 10, 14), mse, "like"),
        "m_unetr": (lambda c: N.UNETR(c, 2, cube16, feature_size=4, hidden_size=24, mlp_dim=24,
                                      num_heads=2), 1, cube16, mse, "like"),
        # the second batch (2026-12-04)
        "m_mednext": (lambda c: N.MedNeXt(3, 4, c, 2, kernel_size=3, blocks_down=(1, 1),
                                          blocks_bottleneck=1, blocks_up=(1, 1),
                                          use_residual_connection=True), 1, cube16, mse, "like"),
        "m_mednext_grn_ds": (lambda c: _Heads(N.MedNeXt(
            3, 4, c, 2, kernel_size=5, blocks_down=(1, 1), blocks_bottleneck=1, blocks_up=(1, 1),
            deep_supervision=True, global_resp_norm=True)), 1, cube16, mse, "like"),
        "m_ahnet": (lambda c: N.AHNet((1, 1, 1, 1), 3, c, 2, psp_block_num=2), 1, cube32, mse,
                    "like"),
        "m_dints": (_dints, 1, cube32, mse, "like"),
        "m_segresnetds2": (lambda c: _Heads(N.SegResNetDS2(3, 4, c, 2, norm="instance",
                                                           blocks_down=(1, 1, 1))), 1, cube16,
                           mse, "like"),
        "m_patchdiscriminator": (lambda c: _Heads(N.PatchDiscriminator(3, 4, c, num_layers_d=2)),
                                 1, cube32, mse, "like"),
        "m_seresnet50": (lambda c: N.SEResNet50((1, 1, 1, 1), spatial_dims=3, in_channels=c,
                                                num_classes=3, inplanes=8, reduction=4), 1,
                         cube32, ce, "class"),
        "m_densenet121": (lambda c: N.DenseNet121(3, c, 3, init_features=8, growth_rate=4,
                                                  block_config=(1, 1, 1, 1)), 1, cube32, ce,
                          "class"),
        "m_critic": (lambda c: N.Critic((c, *cube16), (4, 8), (2, 2), dropout=0.0), 1, cube16,
                     mse, "like"),
        "m_autoencoderkl": (lambda c: _Heads(N.AutoencoderKL(
            3, c, c, num_res_blocks=(1, 1), channels=(4, 8), attention_levels=(False, False),
            latent_channels=2, norm_num_groups=4, with_encoder_nonlocal_attn=False,
            with_decoder_nonlocal_attn=False)), 1, cube16, mse, "like"),
        "m_vqvae": (lambda c: _Heads(N.VQVAE(
            3, c, c, channels=(4, 8), num_res_layers=1, num_res_channels=(4, 8),
            downsample_parameters=((2, 4, 1, 1), (2, 4, 1, 1)),
            upsample_parameters=((2, 4, 1, 1, 0), (2, 4, 1, 1, 0)), num_embeddings=8,
            embedding_dim=4)), 1, cube16, mse, "like"),
    } | ({"m_swinunetr": (lambda c: N.SwinUNETR(c, 2, feature_size=12, depths=(1, 1, 1, 1),
                                                num_heads=(1, 1, 1, 1), window_size=4), 1,
                          cube32, mse, "like")} if importlib.util.find_spec("einops") else {})


def _dints(c):
    from monai.networks.nets.dints import DiNTS, TopologyInstance  # deferred: as above

    space = TopologyInstance(channel_mul=0.25, num_blocks=3, num_depths=3, spatial_dims=3)
    return DiNTS(space, c, 2)


def _nnunet():
    """nnU-Net's networks and the unet package, where installed."""
    out = {}
    if importlib.util.find_spec("dynamic_network_architectures"):
        from dynamic_network_architectures.architectures import unet as D  # deferred: optional

        inorm = dict(norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
                     nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True}, conv_bias=True)
        bnorm = dict(norm_op=nn.BatchNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
                     nonlin=nn.ReLU, nonlin_kwargs={"inplace": True}, conv_bias=True)
        size = (16, 12, 20)
        out |= {
            "nn_plain": (lambda c: D.PlainConvUNet(c, 3, (4, 8, 16), nn.Conv3d, 3, (1, 2, 2), 2,
                                                   2, 2, **inorm), 1, size, mse, "like"),
            "nn_plain_ds": (lambda c: _Heads(D.PlainConvUNet(
                c, 3, (4, 8, 16), nn.Conv3d, 3, (1, 2, 2), 2, 2, 2, deep_supervision=True,
                **inorm)), 1, size, mse, "like"),
            "nn_plain_aniso": (lambda c: D.PlainConvUNet(
                c, 3, (4, 8, 8), nn.Conv3d, [(1, 3, 3), 3, 3], [(1, 1, 1), (1, 2, 2), (2, 2, 2)],
                2, 2, 1, nonlin_first=True, **bnorm), 1, (8, 12, 20), mse, "like"),
            "nn_resenc": (lambda c: D.ResidualEncoderUNet(c, 3, (4, 8, 16), nn.Conv3d, 3,
                                                          (1, 2, 2), (1, 2, 2), 2, 1, **inorm),
                          1, size, mse, "like"),
            "nn_resunet": (lambda c: D.ResidualUNet(c, 3, (4, 8, 16), nn.Conv3d, 3, (1, 2, 2),
                                                    (1, 2, 2), 2, (1, 1), **inorm), 1, size, mse,
                           "like"),
        }
    if importlib.util.find_spec("unet"):
        import unet as U  # deferred: optional

        out |= {
            "unet_batch": (lambda c: U.UNet3D(in_channels=c, out_classes=2,
                                              num_encoding_blocks=3, out_channels_first_layer=4,
                                              normalization="batch", padding=1), 1,
                           (16, 12, 20), mse, "like"),
            "unet_residual": (lambda c: U.UNet3D(in_channels=c, out_classes=2,
                                                 num_encoding_blocks=3,
                                                 out_channels_first_layer=4,
                                                 normalization="instance", residual=True,
                                                 preactivation=True,
                                                 upsampling_type="trilinear", padding=1), 1,
                              (16, 12, 20), mse, "like"),
            "unet_valid": (lambda c: U.UNet3D(in_channels=c, out_classes=2,
                                              num_encoding_blocks=2, out_channels_first_layer=4,
                                              padding=0, pooling_type="avg",
                                              activation="PReLU"), 1, (28, 28, 28), mse, "like"),
        }
    return out


def _pytorch3dunet():
    """pytorch-3dunet's networks (``pytorch3dunet``, with scikit-image), where installed."""
    if not importlib.util.find_spec("pytorch3dunet"):
        return {}
    from pytorch3dunet.unet3d import model as P  # deferred: optional

    small = dict(f_maps=8, num_groups=4, num_levels=3, final_sigmoid=False)
    size = (16, 12, 20)
    return {
        "p3_unet": (lambda c: P.UNet3D(c, 2, **small), 1, size, ce, "class"),
        "p3_unet_bcr_odd": (lambda c: P.UNet3D(c, 2, layer_order="bcr", **small), 2,
                            (18, 14, 22), mse, "like"),
        "p3_unet_deconv_cgl": (lambda c: P.UNet3D(c, 2, layer_order="cgl", upsample="deconv",
                                                  **small), 1, size, mse, "like"),
        "p3_unet_dropout": (lambda c: P.UNet3D(c, 2, layer_order="gcrd", dropout_prob=0.2,
                                               **small), 1, size, mse, "like"),
        "p3_unet_trilinear_cbe": (lambda c: P.UNet3D(c, 2, layer_order="cbe",
                                                     upsample="trilinear", **small), 1, size,
                                  mse, "like"),
        "p3_resunet": (lambda c: P.ResidualUNet3D(c, 2, **small), 1, size, mse, "like"),
        "p3_resunet_se": (lambda c: P.ResidualUNetSE3D(c, 2, **small), 1, size, mse, "like"),
        "p3_unet_not_seg": (lambda c: P.UNet3D(c, 1, is_segmentation=False, **small), 1, size,
                            mse, "like"),
    }


#: networks that draw random numbers per sample (VAEs' torch.randn_like, EfficientNet's
#: stochastic depth): with data replicas each draws for its own samples, as under torch's
#: DDP, which one process on the whole batch cannot match
PER_REPLICA_RANDOM = {"m_varautoencoder", "m_segresnetvae", "m_efficientnet"}


def _outcome(grid, name, entry) -> tuple[str, str]:
    factory, c, size, loss, kind = entry
    try:
        return check_model(grid, ((lambda c: factory(c)), c, size, loss, kind, None), name)
    except AssertionError as exc:
        return "WRONG", str(exc).splitlines()[0]
    except Exception as exc:   # noqa: BLE001 - reported per network, the others still run
        return "CRASH", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _give_back_memory() -> None:
    """Free what a network left behind before the next one: its tensors and glibc's freed
    pages (52 networks in a row on 4 ranks otherwise outgrew 24 GiB by VNet's turn)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:   # pragma: no cover - not glibc
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", default="1x2x1x1,1x1x2x1,1x2x2x1,2x2x1x1",
                    help="data x spatial grids, DxXxYxZ (each uses its product of ranks)")
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    args = ap.parse_args()

    from mpi4py import MPI

    from hpcpar.testing.oracles import on_grids

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    models = _monai() | _nnunet() | _pytorch3dunet()
    if args.only:
        models = {k: v for k, v in models.items() if k in args.only.split(",")}
    grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
    rows: list[tuple[str, str, str, str]] = []

    def each(grid):
        for name, entry in models.items():
            if grid.data > 1 and name in PER_REPLICA_RANDOM:
                continue
            got, line = _outcome(grid, name, entry)
            _give_back_memory()
            verdicts = grid.comm.allgather(got)
            if grid.rank == 0:
                worst = next((v for v in verdicts if v in ("WRONG", "CRASH")), got)
                rows.append((name, grid.spec(), worst, line))
                print(f"{name:28s} {grid.spec():9s} {worst:8s} {line[:160]}", flush=True)

    on_grids(comm, grids, each)
    bad = comm.allreduce(sum(1 for r in rows if r[2] in ("WRONG", "CRASH")))
    counts = comm.gather(rows, root=0)
    if comm.rank == 0:
        every = [r for part in counts for r in part]
        by = {}
        for name, _, got, _ in every:
            by.setdefault(name, set()).add(got)
        print(f"# {len(by)} configurations on {len(grids)} grids: "
              f"{sum(1 for v in by.values() if v == {'exact'})} exact on every grid, "
              f"{sum(1 for v in by.values() if 'refused' in v and v <= {'exact', 'refused'})} "
              f"refused on some, {bad} wrong or crashed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
