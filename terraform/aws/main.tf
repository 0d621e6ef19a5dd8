# fedbroker job-node infrastructure on AWS: one VPC with private subnets in
# 2+ AZs, a security group for NCCL/EFA between job nodes, a cluster placement
# group, a least-privilege instance profile and a launch template (GPU AMI,
# IMDSv2, encrypted root). The broker launches instances itself (RunInstances
# with the instance type of the chosen offer); this module only prepares what
# those calls reference. See README.md.

locals {
  name = var.name_prefix

  # AZ -> private /20 (index i of the VPC's /20s). The NAT subnet is the VPC's
  # last /24, inside /20 number 15, hence at most 15 AZs (validated).
  private_cidrs = { for i, az in var.availability_zones : az => cidrsubnet(var.vpc_cidr, 20 - tonumber(split("/", var.vpc_cidr)[1]), i) }
  public_cidr   = cidrsubnet(var.vpc_cidr, 24 - tonumber(split("/", var.vpc_cidr)[1]), pow(2, 24 - tonumber(split("/", var.vpc_cidr)[1])) - 1)

  ami_id = var.gpu_ami_id != null ? var.gpu_ami_id : data.aws_ami.dlami[0].id
}

data "aws_partition" "current" {}

# Fallback when gpu_ami_id is null: the newest AWS Deep Learning Base GPU AMI.
data "aws_ami" "dlami" {
  count       = var.gpu_ami_id == null ? 1 : 0
  owners      = ["amazon"]
  most_recent = true

  filter {
    name   = "name"
    values = [var.gpu_ami_name_filter]
  }

  filter {
    name   = "architecture"
    values = ["x86_64"]
  }

  filter {
    name   = "state"
    values = ["available"]
  }
}

# The chosen AMI itself, for its root device name (/dev/sda1 on Ubuntu DLAMIs,
# /dev/xvda on Amazon Linux ones) so the encrypted root mapping hits the root.
data "aws_ami" "gpu" {
  owners = var.gpu_ami_id == null ? ["amazon"] : null

  filter {
    name   = "image-id"
    values = [local.ami_id]
  }
}

# ------------------------------------------------------------------ network

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11: VPC flow logs are the operator's account-wide choice (log bucket, retention, cost); NCCL traffic makes them costly here.
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = { Name = "${local.name}-vpc" }
}

# Lock down the VPC's default security group: nothing may use it by accident.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id

  tags = { Name = "${local.name}-default-deny" }
}

resource "aws_subnet" "private" {
  for_each = local.private_cidrs

  vpc_id                  = aws_vpc.this.id
  availability_zone       = each.key
  cidr_block              = each.value
  map_public_ip_on_launch = false

  tags = { Name = "${local.name}-private-${each.key}", "fedbroker:tier" = "private" }
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id

  tags = { Name = "${local.name}-private" }
}

resource "aws_route_table_association" "private" {
  for_each = aws_subnet.private

  subnet_id      = each.value.id
  route_table_id = aws_route_table.private.id
}

# Free gateway endpoint: checkpoint and dataset traffic to S3 stays off the NAT.
resource "aws_vpc_endpoint" "s3" {
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${var.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]

  tags = { Name = "${local.name}-s3" }
}

# Optional egress: one NAT gateway in a /24 public subnet of the first AZ.
# The subnet holds only the NAT gateway; it assigns no public IPs on launch.
resource "aws_internet_gateway" "this" {
  count  = var.enable_nat_gateway ? 1 : 0
  vpc_id = aws_vpc.this.id

  tags = { Name = "${local.name}-igw" }
}

resource "aws_subnet" "nat" {
  count = var.enable_nat_gateway ? 1 : 0

  vpc_id                  = aws_vpc.this.id
  availability_zone       = var.availability_zones[0]
  cidr_block              = local.public_cidr
  map_public_ip_on_launch = false

  tags = { Name = "${local.name}-nat", "fedbroker:tier" = "nat" }
}

resource "aws_route_table" "nat" {
  count  = var.enable_nat_gateway ? 1 : 0
  vpc_id = aws_vpc.this.id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }

  tags = { Name = "${local.name}-nat" }
}

resource "aws_route_table_association" "nat" {
  count = var.enable_nat_gateway ? 1 : 0

  subnet_id      = aws_subnet.nat[0].id
  route_table_id = aws_route_table.nat[0].id
}

resource "aws_eip" "nat" {
  #checkov:skip=CKV2_AWS_19: this EIP belongs to the NAT gateway, not to an EC2 instance.
  count  = var.enable_nat_gateway ? 1 : 0
  domain = "vpc"

  tags = { Name = "${local.name}-nat" }
}

resource "aws_nat_gateway" "this" {
  count = var.enable_nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.nat[0].id

  tags       = { Name = "${local.name}-nat" }
  depends_on = [aws_internet_gateway.this]
}

resource "aws_route" "private_default" {
  count = var.enable_nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

# ------------------------------------------------------------ security group

# Job nodes of one gang talk NCCL to each other on arbitrary ports: torchrun's
# rendezvous (29400), NCCL's bootstrap and socket transport (ephemeral TCP
# ports chosen at run time) and, on EFA-capable types, the EFA SRD transport,
# which is not TCP/UDP at all. AWS requires an EFA-enabled security group to
# allow ALL inbound AND ALL outbound traffic to and from the group itself, so
# both self-referencing rules below use protocol -1 (all). Only members of the
# group are reachable this way; nothing else gets in.
resource "aws_security_group" "nodes" {
  name_prefix = "${local.name}-nodes-"
  description = "fedbroker GPU job nodes: all traffic among members (NCCL/EFA), SSH only from admin_cidr"
  vpc_id      = aws_vpc.this.id

  tags = { Name = "${local.name}-nodes" }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "nodes_self" {
  security_group_id            = aws_security_group.nodes.id
  description                  = "All traffic from other job nodes (NCCL sockets, torchrun rendezvous, EFA)"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.nodes.id
}

resource "aws_vpc_security_group_egress_rule" "nodes_self" {
  security_group_id            = aws_security_group.nodes.id
  description                  = "All traffic to other job nodes (NCCL sockets, torchrun rendezvous, EFA)"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.nodes.id
}

resource "aws_vpc_security_group_ingress_rule" "nodes_ssh" {
  count = var.admin_cidr == null ? 0 : 1

  security_group_id = aws_security_group.nodes.id
  description       = "SSH from the admin range only"
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  cidr_ipv4         = var.admin_cidr
}

resource "aws_vpc_security_group_egress_rule" "nodes_https" {
  security_group_id = aws_security_group.nodes.id
  description       = "HTTPS out: container registries, AWS APIs (SSM, ECR, S3), package mirrors"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "nodes_broker" {
  for_each = { for pair in setproduct(var.broker_cidr_blocks, var.broker_ports) : "${pair[0]}:${pair[1]}" => pair }

  security_group_id = aws_security_group.nodes.id
  description       = "Node agent to the broker's job store / Redis"
  ip_protocol       = "tcp"
  from_port         = each.value[1]
  to_port           = each.value[1]
  cidr_ipv4         = each.value[0]
}

# ------------------------------------------------------------ placement group

# Multi-node gangs go into one cluster placement group: same spine, lowest
# latency, full bisection bandwidth for NCCL all-reduce.
resource "aws_placement_group" "gang" {
  name     = "${local.name}-gang"
  strategy = "cluster"
}

# ------------------------------------------------------------------ IAM

# The node role grants only what a job node needs, and by default nothing:
# the node agent talks to the broker's database and Redis (network, not IAM),
# reads its job tags and the spot notice from IMDS (no IAM), and the broker,
# not the node, creates and terminates instances. Each optional grant below is
# off until its variable is set.
data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${local.name}-node-"
  description        = "fedbroker GPU job node (least privilege; optional SSM, ECR pull, checkpoint prefix)"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
}

# Optional: Session Manager instead of SSH (the AWS-managed minimum for SSM).
resource "aws_iam_role_policy_attachment" "ssm" {
  count      = var.enable_ssm ? 1 : 0
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

data "aws_iam_policy_document" "node" {
  count = length(var.ecr_repository_arns) > 0 || var.checkpoint_bucket_arn != null ? 1 : 0

  # ecr:GetAuthorizationToken has no resource-level permissions: AWS only
  # accepts "*" for it. The token alone reads nothing; the pulls are limited
  # to the listed repositories by the next statement.
  dynamic "statement" {
    for_each = length(var.ecr_repository_arns) > 0 ? [1] : []
    content {
      sid       = "EcrLogin"
      actions   = ["ecr:GetAuthorizationToken"]
      resources = ["*"]
    }
  }

  dynamic "statement" {
    for_each = length(var.ecr_repository_arns) > 0 ? [1] : []
    content {
      sid       = "EcrPullListedRepos"
      actions   = ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
      resources = var.ecr_repository_arns
    }
  }

  # Checkpoints: read/write/delete objects under one prefix of one bucket, and
  # list only that prefix (resume finds the newest checkpoint). No bucket-level
  # writes, no other buckets.
  dynamic "statement" {
    for_each = var.checkpoint_bucket_arn != null ? [1] : []
    content {
      sid       = "CheckpointObjects"
      actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
      resources = ["${var.checkpoint_bucket_arn}/${var.checkpoint_prefix}*"]
    }
  }

  dynamic "statement" {
    for_each = var.checkpoint_bucket_arn != null ? [1] : []
    content {
      sid       = "CheckpointList"
      actions   = ["s3:ListBucket"]
      resources = [var.checkpoint_bucket_arn]
      condition {
        test     = "StringLike"
        variable = "s3:prefix"
        values   = ["${var.checkpoint_prefix}*"]
      }
    }
  }
}

resource "aws_iam_role_policy" "node" {
  count  = length(data.aws_iam_policy_document.node)
  name   = "${local.name}-node"
  role   = aws_iam_role.node.id
  policy = data.aws_iam_policy_document.node[0].json
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${local.name}-node-"
  role        = aws_iam_role.node.name
}

# ------------------------------------------------------------ launch template

# No instance type: the broker sets it per offer in RunInstances. No network
# interfaces either, so the broker may pass SubnetId per zone; the subnets are
# private and assign no public IP.
resource "aws_launch_template" "node" {
  name_prefix            = "${local.name}-node-"
  description            = "fedbroker GPU job node"
  image_id               = local.ami_id
  ebs_optimized          = true
  update_default_version = true
  vpc_security_group_ids = [aws_security_group.nodes.id]

  iam_instance_profile {
    name = aws_iam_instance_profile.node.name
  }

  # IMDSv2 only. Hop limit 1: the agent on the host reads the spot notice and
  # job tags, containers cannot reach the node role's credentials.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  block_device_mappings {
    device_name = data.aws_ami.gpu.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.ebs_kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${local.name}-node", "fedbroker:managed-by" = "fedbroker" })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { Name = "${local.name}-node", "fedbroker:managed-by" = "fedbroker" })
  }
}
