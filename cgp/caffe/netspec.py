"""pycaffe's NetSpec: write a net prototxt from Python, as Caffe's tutorials do.

    n = caffe.NetSpec()
    n.data, n.label = L.Data(source="mnist:train", batch_size=64, ntop=2,
                             transform_param=dict(scale=1. / 255))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type="xavier"))
    text = str(n.to_proto())

L.<Type>(*bottoms, **fields) makes a layer of that Caffe type: a field that LayerParameter
has (name, param, include, loss_weight, transform_param, ...) is set there, any other in
the type's own *_param message (kernel_size -> convolution_param.kernel_size). A dict fills
a message, a list a repeated field; enums may be given by name ("MAX") or as
P.Pooling.MAX. ntop=k gives k tops (ntop=0: none, and L.<Type> returns the layer itself,
which a NetSpec attribute may name), in_place=True names the top as the bottom. Layers and
tops are named after the NetSpec attribute they are assigned to, else <Type><k>. A bottom
that is not a top raises TypeError, as Caffe's; nothing else is checked here: cgp checks the
net when it builds it.
"""
from collections import OrderedDict

from cgp.errors import CgpError
from cgp.proto import caffe_pb2


def _param_fields():
    """Caffe type name -> its LayerParameter field: ConvolutionParameter's field
    convolution_param serves type "Convolution" (the message name less "Parameter")."""
    fields = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            fields[field.message_type.name[:-len("Parameter")]] = field.name
    return fields


PARAM_FIELDS = _param_fields()
PARAM_FIELDS["Deconvolution"] = "convolution_param"   # a type without a message of its own


def assign(message, name, value, where):
    """message.name = value, the way Caffe's NetSpec does: dicts fill sub-messages, lists
    (or a single value) fill repeated fields, enum names are looked up."""
    field = message.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise CgpError(f"{where}: {type(message).__name__} has no field '{name}'")
    repeated = field.is_repeated
    values = value if isinstance(value, (list, tuple)) else [value]
    if repeated:
        target = getattr(message, name)
        for item in values:
            if field.message_type is not None:
                fill(target.add(), item, f"{where}.{name}")
            else:
                target.append(_scalar(field, item, where))
    elif isinstance(value, (list, tuple)):
        raise CgpError(f"{where}: field '{name}' takes one value, got {value!r}")
    elif field.message_type is not None:
        fill(getattr(message, name), value, f"{where}.{name}")
    else:
        setattr(message, name, _scalar(field, value, where))


def fill(message, values, where):
    if not isinstance(values, dict):
        raise CgpError(f"{where}: a {type(message).__name__} is given as a dict, got "
                       f"{values!r}")
    for key, value in values.items():
        assign(message, key, value, where)


def _scalar(field, value, where):
    if field.enum_type is not None and isinstance(value, str):
        number = field.enum_type.values_by_name.get(value)
        if number is None:
            names = ", ".join(field.enum_type.values_by_name)
            raise CgpError(f"{where}: '{value}' is not a value of {field.name} ({names})")
        return number.number
    return value


class BottomTypeError(CgpError, TypeError):
    """A bottom given to L.<Type>(...) that is not a Top: a TypeError, as in Caffe's NetSpec,
    and a user's mistake that the command line reports in one line."""


class Top:
    """One top of a layer made by L.<Type>(...): what later layers take as a bottom."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def to_proto(self):
        """A NetParameter of this top and every layer it depends on."""
        return to_proto(self)


class Function:
    """One layer being specified: its type, its bottoms (Tops) and its fields."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for i, top in enumerate(inputs):
            if not isinstance(top, Top):
                # Caffe's very words: scripts match them.
                raise BottomTypeError(f"{type_name} input {i} is not a Top (type is "
                                      f"{type(top)})")
        self.inputs = list(inputs)
        self.params = dict(params)
        self.ntop = int(self.params.pop("ntop", 1))
        self.in_place = bool(self.params.pop("in_place", False))
        if self.in_place and (len(self.inputs) != 1 or self.ntop != 1):
            raise CgpError(f"L.{type_name}: in_place needs one bottom and one top")
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _top_name(self, top, names, counts):
        if top not in names:
            counts[self.type_name] = counts.get(self.type_name, 0) + 1
            names[top] = f"{self.type_name}{counts[self.type_name]}"
        return names[top]

    def _name(self, names, counts):
        if self not in names:
            if self.ntop > 0:
                names[self] = self._top_name(self.tops[0], names, counts)
            else:
                counts[self.type_name] = counts.get(self.type_name, 0) + 1
                names[self] = f"{self.type_name}{counts[self.type_name]}"
        return names[self]

    def _to_proto(self, layers, names, counts):
        if self in layers:
            return
        bottoms = []
        for top in self.inputs:
            top.fn._to_proto(layers, names, counts)
            bottoms.append(layers[top.fn].top[top.n])
        lp = caffe_pb2.LayerParameter(type=self.type_name, bottom=bottoms)
        if self.in_place:
            lp.top.extend(bottoms)
        else:
            lp.top.extend(self._top_name(top, names, counts) for top in self.tops)
        lp.name = self._name(names, counts)
        where = f"layer '{lp.name}' (L.{self.type_name})"
        own = PARAM_FIELDS.get(self.type_name)
        own_fields = getattr(lp, own).DESCRIPTOR.fields_by_name if own else {}
        for key, value in self.params.items():
            if key in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name:
                assign(lp, key, value, where)
            elif key in own_fields:
                assign(getattr(lp, own), key, value, where)
            else:
                raise CgpError(f"{where}: '{key}' is a field of neither LayerParameter nor "
                               f"{own or f'a {self.type_name} parameter message'}")
        layers[self] = lp


def _function(item):
    """The layer that makes `item`: a Top's, or a top-less layer (ntop=0) itself."""
    return item if isinstance(item, Function) else item.fn


def to_proto(*tops):
    """A NetParameter holding the layers that make `tops` (or top-less layers), each after
    its bottoms."""
    layers, names, counts = OrderedDict(), {}, {}
    for top in tops:
        _function(top)._to_proto(layers, names, counts)
    return caffe_pb2.NetParameter(layer=list(layers.values()))


class NetSpec:
    """Tops assigned as attributes (n.conv1 = L.Convolution(...)) name their layers, as do
    top-less layers (n.silence = L.Silence(n.x, ntop=0)); to_proto() writes every assigned
    top and what it depends on, in assignment order."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        if not isinstance(value, (Top, Function)):
            raise CgpError(f"n.{name} = {value!r}: a NetSpec holds tops made by L.<Type>(...)")
        self.tops[name] = value

    def __getattr__(self, name):
        tops = self.__dict__.get("tops", {})
        if name not in tops:
            raise AttributeError(f"NetSpec has no top '{name}' (it has: "
                                 f"{', '.join(tops) or 'none'})")
        return tops[name]

    __setitem__ = __setattr__

    def __getitem__(self, name):
        return self.__getattr__(name)

    def __delitem__(self, name):
        del self.tops[name]

    def keys(self):
        return list(self.tops)

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {top: name for name, top in self.tops.items()}
        layers, counts = OrderedDict(), {}
        for top in self.tops.values():
            _function(top)._to_proto(layers, names, counts)
        return caffe_pb2.NetParameter(layer=list(layers.values()))


class Layers:
    """caffe.layers (L): L.Convolution(...) specifies a layer of type Convolution."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def layer(*bottoms, **fields):
            fn = Function(name, bottoms, fields)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        return layer


class Parameters:
    """caffe.params (P): P.Pooling.MAX is PoolingParameter.MAX, P.Data.LMDB DataParameter's."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        message = getattr(caffe_pb2, name + "Parameter", None)
        if message is None:
            raise AttributeError(f"caffe.params has no '{name}' (caffe.proto has no "
                                 f"{name}Parameter)")
        return message


layers = Layers()
params = Parameters()
